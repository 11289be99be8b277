"""Counterfactual replay: from one request, what every other arm would have done (greedy:
exactly; sampled: in expectation)."""

import dataclasses
import json

import pytest
from test_engine import none_of_the_last_four, prompts

from autotune.rewards.costs import NO_MODEL, OFF_ROUNDS, VERIFY_SLOPE_PRIOR, CostModel
from autotune.rewards.replay import (
    arm_rewards,
    batch_rounds,
    draft_cost_owner,
    hybrid_estimates,
    hybrid_rounds,
    kept_chain,
    lookup_chains,
    replay_arm,
    target_probabilities,
    verify_owners,
)
from engine import OFF, Arm, GenerationMetrics, HybridDrafter, NGramDrafter, SamplingParams, SpeculativeEngine
from engine.drafters import lookup_of


@pytest.fixture(scope="module")
def engine(target, draft_model):
    # "self" drafts with the target itself: under sampling every draft is then kept.
    return SpeculativeEngine(target, {"small": draft_model, "ngram": NGramDrafter(max_ngram=3), "self": target,
                                      "hybrid": HybridDrafter(draft_model)})


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(1.0, 0.9, seed=3), *(
    pytest.param(s, marks=pytest.mark.slow) for s in (
        SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, logit_bias={t: 2.0 for t in range(0, 64, 6)}),
        SamplingParams(logits_processor=none_of_the_last_four)))])
def test_replaying_an_off_request_predicts_every_arms_rounds_exactly(engine, sampling):
    """Greedy, also with penalties and a logit bias, or a caller's logits processor (the drafters
    draft with them, and so does the replay); and sampled with a seed (coupled, engine/coupled.py:
    the output is the target's draws whatever the arm, and each draft the drafter's draw)."""
    for i, prompt in enumerate(prompts(12, seed=4)):
        max_new = 20 + i % 7
        output = engine.generate(prompt, OFF, max_new, sampling).tokens
        for arm in (Arm("small", 1), Arm("small", 3), Arm("small", 8), Arm("ngram", 2), Arm("ngram", 6),
                    Arm("hybrid", 3), Arm("self", 4)):
            served = engine.generate(prompt, arm, max_new, sampling).metrics
            rounds = replay_arm(engine, arm, prompt, output, max_new, sampling)
            assert (len(rounds), sum(rounds)) == (served.rounds, served.drafted), (i, arm)
            assert sum(k > 0 for k in rounds) == served.draft_rounds, (i, arm)


def test_a_hybrids_other_ks_are_priced_by_its_inner_drafters_costs(engine, draft_model):
    # The hybrid's own cost per round is the share of its rounds its model drafted (lookups cost
    # next to nothing), a property of the text; how a round's cost grows with K is its model's.
    assert draft_cost_owner(engine, "hybrid") == "small"  # a drafter of its own running the same model
    assert draft_cost_owner(engine, "small") == "small" and draft_cost_owner(engine, "ngram") == "ngram"
    inner = engine.drafters["small"]
    alone = SpeculativeEngine(engine.target, {"hybrid": HybridDrafter(inner), "it": inner})
    assert draft_cost_owner(alone, "hybrid") == "it"  # the very drafter (a feature head is shared so)
    assert draft_cost_owner(SpeculativeEngine(engine.target, {"hybrid": HybridDrafter(draft_model)}),
                            "hybrid") == "hybrid"  # no other drafter runs its model: its own costs


def test_replaying_a_batch_predicts_its_rounds_and_draft_steps_exactly(engine):
    batch = prompts(6, seed=8)
    limits = [12 + 3 * i for i in range(6)]
    outputs = [r.tokens for r in engine.generate_batch(batch, OFF, limits)]
    for arm in (Arm("small", 3), Arm("ngram", 4), Arm("hybrid", 4)):
        served = engine.generate_batch(batch, arm, limits).metrics
        rounds = batch_rounds([replay_arm(engine, arm, p, o, n) for p, o, n in zip(batch, outputs, limits)])
        assert (len(rounds), sum(rounds)) == (served.rounds, served.draft_steps), arm
        assert sum(k > 0 for k in rounds) == served.draft_rounds, arm


@pytest.mark.slow
def test_a_sampled_replay_predicts_rounds_in_expectation(engine):
    # Acceptance probabilities are taken along the output sampled, not along each arm's drafts:
    # over 24 requests the predicted rounds land within a few % of the real ones (1-2 % measured).
    for arm in (Arm("small", 1), Arm("small", 4), Arm("ngram", 3), Arm("hybrid", 3)):
        served = predicted = 0
        for i, prompt in enumerate(prompts(24, seed=5)):
            sampling = SamplingParams(temperature=1.0, seed=i, coupled=False)  # the rejection rule
            result = engine.generate(prompt, arm, max_new_tokens=24, sampling=sampling)
            served += result.metrics.rounds
            predicted += len(replay_arm(engine, arm, prompt, result.tokens, 24, sampling))
        assert predicted == pytest.approx(served, rel=0.06), arm
    for i, prompt in enumerate(prompts(6, seed=6)):  # q = p: every draft kept, so exactly
        sampling = SamplingParams(temperature=0.7, seed=i)
        result = engine.generate(prompt, Arm("self", 3), max_new_tokens=20, sampling=sampling)
        rounds = replay_arm(engine, Arm("self", 3), prompt, result.tokens, 20, sampling)
        assert (len(rounds), sum(rounds)) == (result.metrics.rounds, result.metrics.drafted)


def test_the_targets_replayed_distributions_hold_the_end_until_min_tokens(engine):
    prompt, stop = prompts(1)[0], 9
    sampling = SamplingParams(1.0, seed=0, min_tokens=5, stop_token_ids=[stop])
    output = engine.generate(prompt, OFF, 12, sampling).tokens
    p = target_probabilities(engine, prompt + output, len(prompt) + 1, sampling)  # row j: output token j + 1
    assert p[:4, stop].tolist() == [0.0] * 4 and (p[4:, stop] > 0).all()


def verified(costs: CostModel, width: int, seconds: float, rounds: int = 100) -> None:
    """`costs` observes a request of `rounds` verifies of `width` tokens, `seconds` each."""
    costs.observe(OFF, GenerationMetrics(rounds=rounds, verify_s=rounds * seconds,
                                         verify_by_width={width: [rounds * seconds, rounds]}))


def test_estimated_rewards_follow_acceptance_and_cost():
    costs = CostModel()
    assert costs.verify_cost(3) is None  # nothing measured yet
    verified(costs, 2, 0.005)
    verified(costs, 6, 0.007)
    assert costs.verify_cost(4) == pytest.approx(0.006)  # the line through what was measured
    verified(costs, 1, 0.003)  # a 1-token step skips the multi-token overhead: not on that line
    assert costs.verify_cost(9) == pytest.approx(0.0085)
    assert costs.verify_cost(1) == pytest.approx(0.003)
    one = CostModel()
    verified(one, 1, 0.005)
    assert one.verify_cost(3) > one.verify_cost(1)  # one point: a prior slope, never cheaper


def test_a_batchs_last_rounds_price_no_verify_width():
    """A static batch's narrower verifies come from its last rounds, when most rows have finished:
    cheap for few rows, not for the width. A request's own narrower verifies (a lookup's short
    match) cost what they cost."""
    tail = GenerationMetrics(rounds=33, drafted=200, verify_s=30 * 0.020 + 3 * 0.004,
                             verify_by_width={7: [30 * 0.020, 30], 2: [3 * 0.004, 3]})
    batch, single = CostModel(), CostModel()
    batch.observe(Arm("small", 6), tail, batch=True)
    single.observe(Arm("small", 6), tail)
    assert single.verify_cost(2, "small") == pytest.approx(0.004)
    assert batch.verify_cost(7, "small") == pytest.approx(0.020)
    assert batch.verify_cost(2, "small") == pytest.approx(0.020 * (1 - 5 * VERIFY_SLOPE_PRIOR))  # from width 7


def test_a_burst_of_other_work_moves_no_cost_and_no_verify_is_priced_below_a_step():
    """On a shared machine a request can run 40x slower than the next: a running mean kept such a
    request in every estimate for a hundred requests, a median over the last requests does not."""
    costs = CostModel()
    verified(costs, 1, 0.200)  # the first OFF request, while other work had the cores
    verified(costs, 3, 0.006)
    assert costs.relative_verify_cost(3) == 1.0  # a 3-token verify does at least a step's work
    for _ in range(3):
        verified(costs, 1, 0.005)
    verified(costs, 1, 0.400)  # another burst
    assert costs.off_step() == pytest.approx(0.005)
    assert costs.relative_verify_cost(3) == pytest.approx(1.2)
    for _ in range(costs.window):
        verified(costs, 3, 0.012)  # the machine now runs at half speed for good: the estimate follows
    assert costs.verify_cost(3) == pytest.approx(0.012)


def test_one_long_request_cannot_outvote_several_short_ones():
    """Calibration measures OFF on three short runs; a process's first OFF request, long and cold,
    ran 1.3x slower: counted by all its rounds it set the step every reward was priced by."""
    costs = CostModel()
    for _ in range(3):
        verified(costs, 1, 0.003, rounds=16)
    verified(costs, 1, 0.004, rounds=63)
    assert costs.off_step() == pytest.approx(0.003)


def test_only_rounds_that_drafted_nothing_price_an_off_step():
    """A 1-token verify among drafting rounds finds the target's weights evicted by the drafter:
    dearer than an OFF step, it would make wider verifies look cheap and rewards too high."""
    costs = CostModel()
    verified(costs, 1, 0.005)
    costs.observe(Arm("small", 2), GenerationMetrics(
        rounds=20, drafted=38, draft_steps=38, draft_rounds=19, draft_s=0.02, verify_s=0.131,
        verify_by_width={3: [0.124, 19], 1: [0.007, 1]}))
    assert costs.off_step() == pytest.approx(0.005) and costs.verify_cost(3) == pytest.approx(0.124 / 19)


def test_a_verify_is_priced_as_it_costs_after_its_own_drafters_drafts():
    """After a lookup the target's weights are still in the CPU caches, after a model's drafts
    they are not: one table for both made a model drafter's verifies look cheap."""
    costs = CostModel()
    verified(costs, 1, 0.005)
    for drafter, seconds in (("ngram", 0.006), ("small", 0.008)):
        verifies = {5: [10 * seconds, 10]}
        costs.observe(Arm(drafter, 4), GenerationMetrics(rounds=10, drafted=40, draft_steps=40, draft_rounds=10,
                                                         verify_s=10 * seconds, verify_by_width=verifies))
    assert costs.relative_verify_cost(5, "ngram") == pytest.approx(1.2)
    assert costs.relative_verify_cost(5, "small") == pytest.approx(1.6)
    assert costs.relative_verify_cost(5, "medium") == pytest.approx(1.4)  # never played: every drafter's median


def test_drafters_that_run_no_model_are_priced_from_one_table_of_verify_costs(engine):
    """Their drafts leave the target's weights in the caches, so each verify costs what OFF's
    would: a lookup, a feature head and their hybrid share one table (a table each, priced from
    a few noisy requests, put a head's and its hybrid's 9-token verify at 1.32 and 2.34 steps)."""
    assert verify_owners(engine) == {"small": "small", "ngram": NO_MODEL, "self": "self", "hybrid": "hybrid"}
    costs = CostModel(verify_owners={"ngram": NO_MODEL, "feature": NO_MODEL, "ngram+feature": NO_MODEL})
    verified(costs, 1, 0.005)
    for drafter, seconds in (("ngram", 0.006), ("feature", 0.007), ("small", 0.008)):
        verifies = {5: [10 * seconds, 10]}
        costs.observe(Arm(drafter, 4), GenerationMetrics(rounds=10, drafted=40, draft_steps=40, draft_rounds=10,
                                                         verify_s=10 * seconds, verify_by_width=verifies))
    for drafter in ("ngram", "feature", "ngram+feature"):
        assert costs.relative_verify_cost(5, drafter) == pytest.approx(1.3), drafter
    assert costs.relative_verify_cost(5, "small") == pytest.approx(1.6)
    assert CostModel.from_state(json.loads(json.dumps(costs.state_dict())),
                                costs.verify_owners).relative_verify_cost(5, "ngram+feature") == pytest.approx(1.3)
    each = CostModel()  # a store from before: a table per drafter, merged as it loads
    verified(each, 1, 0.005)
    for drafter, seconds in (("ngram", 0.006), ("feature", 0.007)):
        each.observe(Arm(drafter, 4), GenerationMetrics(rounds=10, drafted=40, draft_steps=40, draft_rounds=10,
                                                        verify_s=10 * seconds, verify_by_width={5: [10 * seconds, 10]}))
    loaded = CostModel.from_state(json.loads(json.dumps(each.state_dict())), costs.verify_owners)
    assert set(loaded.verify) == {OFF_ROUNDS, NO_MODEL}
    assert loaded.relative_verify_cost(5, "ngram+feature") == pytest.approx(1.3)


def test_costs_in_off_steps_come_from_measurements_side_by_side_not_from_medians_of_other_moments():
    """OFF's step measured while the machine ran fast, a drafter's verifies later while it ran
    1.5x slower: their ratio would price the drafter's 3-token verify at 1.8 steps (1.2 side by
    side), every request's implied OFF step 1.5x too long, and its reward 1.5x too high."""
    costs = CostModel()
    verified(costs, 1, 0.005)
    side_by_side = GenerationMetrics(rounds=10, drafted=20, draft_steps=20, draft_rounds=10, draft_s=0.01,
                                     verify_s=0.06, verify_by_width={3: [0.06, 10]})  # 6 ms a verify, 1 ms a round
    costs.observe(Arm("small", 2), side_by_side)
    costs.observe_side_by_side(Arm("small", 2), side_by_side, off_step=0.005)
    slow = GenerationMetrics(rounds=10, drafted=20, draft_steps=20, draft_rounds=10, draft_s=0.015,
                             verify_s=0.09, verify_by_width={3: [0.09, 10]})
    for _ in range(5):
        costs.observe(Arm("small", 2), slow)
    assert costs.verify_cost(3, "small") == pytest.approx(0.009)  # seconds: as requests measure them
    assert costs.relative_verify_cost(3, "small") == pytest.approx(1.2)
    assert costs.relative_verify_cost(4, "small") == pytest.approx(1.2 * (1 + VERIFY_SLOPE_PRIOR))  # not measured
    assert costs.off_step_during(slow, "small") == pytest.approx(0.0075)
    assert costs.relative_draft_cost("small", 2) == pytest.approx(0.2)
    assert costs.relative_draft_cost("ngram", 2) is None  # not measured side by side: seconds stand in
    assert CostModel.from_state(json.loads(json.dumps(costs.state_dict()))).state_dict() == costs.state_dict()
    without = CostModel()  # none side by side (a store from before, a load no calibration ran at)
    verified(without, 1, 0.005)
    without.observe(Arm("small", 2), slow)
    assert without.relative_verify_cost(3, "small") == pytest.approx(1.8)
    without.relative_verify = {"small": {}}  # a table with no width in it (a store saved so) prices as none
    assert without.relative_verify_cost(3, "small") == pytest.approx(1.8)


def test_one_slow_moment_during_calibration_moves_no_cost(engine, monkeypatch):
    """Calibration prices every reward after it, so a run slowed by other work on the machine
    (here 8x: an OFF run beside small:2, and one of ngram:3's own) must not set a price: each
    drafter runs twice, a third time where the two disagree, and a cost is their median."""
    import threading

    from autotune.rewards.reward import calibrate

    real = engine.generate
    calls: list[tuple[Arm, int]] = []
    slowed: set[int] = set()

    def steady(prompt, arm, max_new_tokens, sampling, **kw):
        """The engine's real rounds, priced at steady made-up speeds (slowed 8x where asked)."""
        result = real(prompt, arm, max_new_tokens, sampling, **kw)
        calls.append((arm, max_new_tokens))
        slow = 8.0 if len(calls) - 1 in slowed else 1.0
        m = result.metrics
        widths = {w: [slow * 0.01 * (1 + 0.1 * (w - 1)) * n, n] for w, (_, n) in m.verify_by_width.items()}
        m = dataclasses.replace(m, draft_s=slow * 0.002 * m.draft_steps, verify_by_width=widths,
                                verify_s=sum(s for s, _ in widths.values()))
        return dataclasses.replace(result, metrics=m)

    monkeypatch.setattr(engine, "generate", steady)
    ks = {"small": [2], "ngram": [3]}
    quiet = calibrate(engine, ks, SamplingParams(), threading.Lock())
    first = {arm: next(i for i, (played, tokens) in enumerate(calls) if played == arm and tokens > 4)
             for arm in (Arm("small", 2), Arm("ngram", 3))}  # the first recorded run of each (after warm-up)
    slowed.update({len(calls) + first[Arm("small", 2)] + 1, len(calls) + first[Arm("ngram", 3)]})
    noisy = calibrate(engine, ks, SamplingParams(), threading.Lock())
    assert [calls[i][0] for i in sorted(slowed)] == [OFF, Arm("ngram", 3)]
    assert noisy.relative_draft_cost("small", 2) == pytest.approx(quiet.relative_draft_cost("small", 2))
    for costs in (quiet, noisy):
        assert costs.relative_verify_cost(3, "small") == pytest.approx(1.2)
        assert costs.relative_verify_cost(4, "ngram") == pytest.approx(1.3)


def test_a_drafters_prefill_is_a_forward_plus_a_cost_per_token():
    costs = CostModel()
    for tokens, seconds in [(100, 0.003), (400, 0.006), (200, 0.004), (700, 0.009), (300, 0.050)]:  # one slow
        costs.observe(Arm("small", 2), GenerationMetrics(rounds=1, prompt_tokens=tokens, draft_prefill_s=seconds))
    assert costs.draft_prefill_cost("small", 1000) == pytest.approx(0.012)  # 2 ms + 10 us a token
    assert costs.draft_prefill_cost("small", 50) == pytest.approx(0.0025)
    assert costs.draft_prefill_cost("ngram", 1000) == 0.0  # never measured


def test_the_off_step_is_inferred_from_the_requests_own_verifies():
    """The machine's speed moves by +-25 % between requests; an OFF step measured on other
    requests would make a request that ran at a slow moment look slower than OFF."""
    costs = CostModel()
    assert costs.off_step() is None
    costs.observe(OFF, GenerationMetrics(rounds=50, verify_s=0.25, verify_by_width={1: [0.25, 50]}))  # 5 ms
    spec = GenerationMetrics(rounds=20, verify_s=0.12, verify_by_width={3: [0.12, 20]})  # 6 ms per 3-token verify
    costs.observe(Arm("small", 2), spec)
    assert costs.off_step_during(spec) == pytest.approx(0.005)
    slow = GenerationMetrics(rounds=20, verify_s=0.24, verify_by_width={3: [0.24, 20]})  # the machine at half speed
    assert costs.off_step_during(slow) == pytest.approx(0.010)  # so was OFF, then
    mixed = GenerationMetrics(rounds=30, verify_s=0.17, verify_by_width={1: [0.05, 10], 3: [0.12, 20]})
    assert costs.off_step_during(mixed) == pytest.approx(0.17 / (10 + 20 * 1.2))  # an n-gram arm's rounds
    assert CostModel.from_state(json.loads(json.dumps(costs.state_dict()))).state_dict() == costs.state_dict()
    # A store saved when costs were discounted sums: each cost starts from its mean
    legacy = CostModel.from_state({"discount": 0.98, "draft": {"small": {"2": [0.05, 20.0, 40.0]}},
                                   "verify": {"1": [0.25, 50.0], "3": [0.12, 20.0]},
                                   "prefill": {"small": [0.1, 1000.0]}, "off_decode": [1.2, 1.0]})
    assert legacy.off_step() == pytest.approx(0.005) and legacy.draft_cost("small", 2) == pytest.approx(0.0025)
    assert legacy.draft_prefill_cost("small", 500) == pytest.approx(0.05) and legacy.off_decode_factor() == 1.2


def test_each_arm_pays_its_own_drafters_prefill(engine):
    prompt = prompts(1, seed=1)[0]
    off = engine.generate(prompt, OFF, max_new_tokens=24)
    spec = engine.generate(prompt, "small:2", max_new_tokens=24)
    assert off.metrics.draft_prefill_s == 0 and 0 < spec.metrics.draft_prefill_s < spec.metrics.prefill_s
    batch = engine.generate_batch(prompts(3, seed=2), "hybrid:2", max_new_tokens=8).metrics
    assert 0 < batch.draft_prefill_s < batch.prefill_s
    assert engine.generate_batch(prompts(3, seed=2), OFF, max_new_tokens=8).metrics.draft_prefill_s == 0
    costs = CostModel()
    costs.observe(OFF, off.metrics)
    costs.observe(Arm("small", 2), spec.metrics)
    replay = [(prompt, off.tokens, 24)]
    before = arm_rewards(engine, [Arm("small", 2)], costs, replay, off.metrics.prefill_s, costs.off_step())
    costs.prefill["small"] = [[1.0, len(prompt)]]  # a drafter that takes a second over this prompt
    after = arm_rewards(engine, [Arm("small", 2)], costs, replay, off.metrics.prefill_s, costs.off_step())
    assert 1 / after["small:2"] - 1 / before["small:2"] == pytest.approx(1.0 / off.metrics.total_s, rel=0.05)


def test_a_draft_round_is_priced_as_a_first_step_plus_further_steps():
    # Measured on the demo family: the first step of a round 0.7 ms more than the others
    # (the target's verify evicted the drafter from the CPU caches).
    def served(k: int, rounds: int = 20, per_round: float = 0.7e-3, per_step: float = 0.9e-3) -> GenerationMetrics:
        return GenerationMetrics(rounds=rounds, draft_rounds=rounds, draft_steps=k * rounds,
                                 draft_s=rounds * (per_round + per_step * k))

    costs = CostModel()
    costs.observe(Arm("small", 2), served(2))
    costs.observe(Arm("small", 2), served(2, rounds=7))
    assert costs.draft_cost("small", 2) == pytest.approx(2.5e-3)  # one K: its own cost, exactly
    assert costs.draft_cost("small", 4) == pytest.approx(5.0e-3)  # and per step beyond it
    costs.observe(Arm("small", 4), served(4, rounds=12))
    assert costs.draft_cost("small", 8) == pytest.approx(0.7e-3 + 8 * 0.9e-3, rel=0.02)  # not 8 x 1.25 ms
    assert costs.draft_cost("small", 1) == pytest.approx(1.6e-3, rel=0.02)
    costs.observe(Arm("small", 1), served(1, per_round=0.5e-3))
    assert costs.draft_cost("small", 1) == pytest.approx(1.4e-3)  # a K that has run: its own cost
    assert costs.draft_cost("ngram", 3) is None  # never served


def test_arms_whose_drafter_never_ran_get_no_estimate(engine):
    prompt = prompts(1, seed=1)[0]
    result = engine.generate(prompt, "small:2", max_new_tokens=24)
    costs = CostModel()
    costs.observe(Arm("small", 2), result.metrics)
    costs.observe(OFF, engine.generate(prompt, OFF, max_new_tokens=24).metrics)
    arms = [OFF, Arm("small", 1), Arm("small", 4), Arm("ngram", 3)]
    estimates = arm_rewards(engine, arms, costs, [(prompt, result.tokens, 24)], result.metrics.prefill_s,
                            costs.verify_cost(1))
    assert set(estimates) == {"off", "small:1", "small:4"}
    assert estimates["off"] == pytest.approx(1.0)
    assert all(r > 0 for r in estimates.values())


def test_a_batch_of_greedy_and_sampled_requests_replays_each_with_its_own_sampling(engine):
    greedy, sampled = prompts(2, seed=11)
    hot = SamplingParams(temperature=1.0, seed=3)
    served = engine.generate_batch([greedy, sampled], "small:2", 16, [SamplingParams(), hot])
    costs = CostModel()
    costs.observe(Arm("small", 2), served.metrics)
    costs.observe(OFF, engine.generate_batch([greedy, sampled], OFF, 16, [SamplingParams(), hot]).metrics)
    rows = [(greedy, served.results[0].tokens, 16), (sampled, served.results[1].tokens, 16)]
    arms = [Arm("small", 1), Arm("small", 2), Arm("small", 4)]

    def estimate(requests, sampling):
        return arm_rewards(engine, arms, costs, requests, served.metrics.prefill_s, costs.off_step(), sampling)

    mixed = estimate(rows, [None, hot])
    assert mixed == pytest.approx(estimate(rows[::-1], [hot, None]))  # each row's own, whatever the order
    assert mixed != pytest.approx(estimate(rows, None))  # not the first row's sampling for both


def test_off_steps_among_a_requests_own_rounds_price_its_verifies_side_by_side():
    """Calibration measured the drafter while the machine ran slow; requests then measure OFF's
    step among their own rounds (`probe_off`), and their pairs outvote calibration's one."""
    costs = CostModel()
    verified(costs, 1, 0.005)
    calibration = GenerationMetrics(rounds=10, drafted=20, draft_steps=20, draft_rounds=10, draft_s=0.015,
                                    verify_s=0.09, verify_by_width={3: [0.09, 10]})
    costs.observe_side_by_side(Arm("small", 2), calibration, off_step=0.005)  # 1.8 steps a verify
    assert costs.relative_verify_cost(3, "small") == pytest.approx(1.8)
    probed = GenerationMetrics(new_tokens=24, rounds=13, drafted=20, draft_steps=20, draft_rounds=10, draft_s=0.01,
                               verify_s=0.075, verify_by_width={3: [0.06, 10], 1: [0.015, 3]},
                               probe_s=0.015, probe_rounds=3, total_s=0.1)
    for _ in range(2):
        costs.observe(Arm("small", 2), probed)
    assert costs.relative_verify_cost(3, "small") == pytest.approx(1.2)  # 6 ms verifies over 5 ms OFF steps
    assert costs.relative_draft_cost("small", 2) == pytest.approx(0.2)
    assert costs.probed == {"small": [2, 0]} and costs.since_off == 0
    assert costs.off_step_during(probed.without_probes(), "small") == pytest.approx(0.005)
    costs.observe(Arm("small", 2), dataclasses.replace(probed, probe_s=0.0, probe_rounds=0,
                                                       verify_by_width={3: [0.06, 10]}, rounds=10))
    assert costs.probed == {"small": [2, 1]} and costs.since_off == 1
    assert [costs.probes_due("small", first, every) for first, every in ((3, 8), (2, 8), (2, 2))] == [True, False, True]
    assert CostModel.from_state(json.loads(json.dumps(costs.state_dict()))).state_dict() == costs.state_dict()


def test_a_hybrid_is_estimated_from_its_inner_drafters_rounds_and_a_scan_of_the_output(target):
    """Where the inner drafter's drafts are always kept (the target drafting for itself, greedy),
    the estimate's rounds must be the rounds the hybrid serves: lookup wherever it proposes, the
    inner drafter elsewhere, each round as far as its drafts are kept."""
    engine = SpeculativeEngine(target, {"self": target, "ngram+self": HybridDrafter(target, min_match=1)})
    lookup = lookup_of(engine.drafters["ngram+self"])
    looked_up_somewhere = False
    for prompt in prompts(9, seed=5):
        output = engine.generate(prompt, Arm("self", 3), 24).tokens
        looked_up, proposed = lookup_chains(lookup, prompt + output, len(prompt) + 1, 6, None)
        for k in (2, 3, 6):
            served = engine.generate(prompt, Arm("ngram+self", k), 24).metrics
            rounds = hybrid_rounds([1.0] * 6, proposed, looked_up, k, 24)
            widths = {w: sum(1 for drafted, _ in rounds if drafted + 1 == w) for w in {d + 1 for d, _ in rounds}}
            assert widths == {w: r for w, (_, r) in served.verify_by_width.items()}, (prompt, k)
            looked_up_somewhere |= any(by_lookup and drafted for drafted, by_lookup in rounds)
    assert looked_up_somewhere

    # The chain a request's rounds give: per position, kept once the ones before it were; past the
    # request's K the last position's fall goes on
    metrics = GenerationMetrics(rounds=10, drafted_per_position=[10, 10], accepted_per_position=[8, 4])
    assert kept_chain(metrics, 2, 4) == pytest.approx([0.8, 0.5, 0.5, 0.5])
    # one hybrid per drafter it chains; the played drafter's own other Ks are `sibling_rewards`'
    played = engine.generate(prompt, Arm("self", 2), 24)
    costs = CostModel()
    costs.observe(Arm("self", 2), played.metrics)
    verified(costs, 1, 0.01)
    estimates = hybrid_estimates(engine, Arm("self", 2), played.metrics, 1.5, prompt, played.tokens, 24, costs,
                                 {"self": [2], "ngram+self": [2, 3]})
    assert set(estimates) == {"ngram+self:2", "ngram+self:3"} and estimates["ngram+self:3"][1] < 0.5


def test_a_batch_replays_the_rows_it_is_given_first_and_counts_every_row_in_off_and_prompts(engine):
    """`replay_rows`: a burst's replay runs its slowest rows only (they decide how long it
    lasts); OFF's rounds and the drafter's prefill still cover the whole batch."""
    first_row, other = (p[:5] for p in prompts(2, seed=5))  # of one length: the drafter's prefill costs alike
    served = engine.generate_batch([first_row, other], "small:2", 16)
    costs = CostModel()
    costs.observe(Arm("small", 2), served.metrics)
    costs.observe(OFF, engine.generate_batch([first_row, other], OFF, 16).metrics)
    rows = [(p, r.tokens, 16) for p, r in zip((first_row, other), served.results)]
    arms = [Arm("small", 1), Arm("small", 4)]

    def estimate(requests, replay_rows=None):
        return arm_rewards(engine, arms, costs, requests, served.metrics.prefill_s, costs.off_step(),
                           replay_rows=replay_rows)

    first = estimate(rows, replay_rows=1)
    assert first == pytest.approx(estimate([rows[0], rows[0]]))  # as if every row were the first
    assert first != pytest.approx(estimate(rows))  # the other row's drafts are not replayed
