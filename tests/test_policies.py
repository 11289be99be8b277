"""Policies on simulated arms with known rewards: converge, follow drift, go OFF, resume."""

import json
import math
import random
from collections import Counter

import pytest

from engine import OFF, Arm
from policies import Context, Outcome, PolicyError, make_policy
from policies.bandits import ArmTable, LoadTotals

ARMS = [Arm("small", k) for k in (1, 2, 4, 8)] + [Arm("ngram", 3)]


CODE = Context("code")


def simulate(policy, means: dict[str, float], steps: int, context=CODE, seed=0, noise=0.15):
    rng = random.Random(seed)
    chosen = []
    for _ in range(steps):
        arm = policy.choose(context)
        reward = rng.gauss(means[str(arm)], noise)
        policy.update(context, arm, Outcome(goodput=100 * reward, reward=reward))
        chosen.append(str(arm))
    return chosen


def means_with_best(best: str, off: float = 1.0) -> dict[str, float]:
    means = {str(a): 1.1 for a in ARMS}
    means["off"] = off
    means[best] = 1.6
    return means


@pytest.mark.parametrize("name", ["ucb", "thompson"])
def test_converges_to_the_best_arm(name):
    policy = make_policy(name, ARMS)
    chosen = simulate(policy, means_with_best("small:4"), 300)
    assert Counter(chosen[-100:])["small:4"] >= 85


@pytest.mark.parametrize("name", ["ucb", "thompson"])
def test_follows_a_switch_of_the_best_arm(name):
    policy = make_policy(name, ARMS)
    simulate(policy, means_with_best("small:4"), 300)
    chosen = simulate(policy, means_with_best("ngram:3"), 300, seed=1)
    assert Counter(chosen[-100:])["ngram:3"] >= 80


@pytest.mark.parametrize("safety", [None, 0.02])
@pytest.mark.parametrize("name", ["ucb", "thompson"])
def test_goes_off_when_every_arm_loses_and_keeps_probing(name, safety):
    means = {str(a): 0.7 for a in ARMS} | {"off": 1.0, "small:1": 0.9}
    offs = []
    for seed in range(5):  # one run's count moves by +-15 with the draws: the mean over five
        policy = make_policy(name, ARMS, safety=safety, seed=seed)
        simulate(policy, means, 200, seed=seed)
        chosen, guarded = [], 0
        for step in range(200):
            chosen += simulate(policy, means, 1, seed=step)
            guarded += policy.table(CODE).guarded
        offs.append(Counter(chosen)["off"])
        assert offs[-1] < 200  # rare probes keep a way back
        if safety is None:  # the guard alone holds the class at OFF most of the time
            assert guarded >= 100
    assert sum(offs) / len(offs) >= 175  # the nearest loser (0.9) still gets probed, the 0.7s hardly


@pytest.mark.parametrize("name", ["ucb", "thompson"])
def test_a_key_where_speculation_loses_spends_little_finding_out(name):
    """Under load every arm loses to OFF (the verify costs every row of the batch) while the
    class's load-1 evidence says speculation wins: conservative exploration must not spend the
    load key's requests finding that out one arm at a time."""
    ks = [1, 2, 3, 4, 6, 8]
    arms = [Arm(d, k) for d in ("small", "distilled", "ngram") for k in ks]
    alone = {"off": 1.0} | {str(a): 1.2 + 0.3 * (a.k == 4) for a in arms}
    busy = {"off": 1.0} | {str(a): 0.95 - 0.05 * ks.index(a.k) for a in arms}  # 0.95 down to 0.70
    settings = {"default": {}, "conservative alone": {"share_weight": 0},
                "neither": {"safety": None, "share_weight": 0}}
    mean = {}
    for setting, options in settings.items():
        rewards = []
        for seed in range(10):
            policy = make_policy(name, arms, seed=seed, **options)
            for request_class in ("code", "docs"):
                simulate(policy, alone, 60, context=Context(request_class), seed=seed, noise=0.25)
            simulate(policy, busy, 12, context=Context("docs", load=8), seed=seed, noise=0.1)
            chosen = simulate(policy, busy, 40, context=Context("code", load=8), seed=100 + seed, noise=0.1)
            rewards += [busy[a] for a in chosen]
        mean[setting] = sum(rewards) / len(rewards)
    # docs' evidence under load, shared, or conservative exploration on its own, each keeps the
    # key near OFF (0.97-0.98 measured; OFF is 1.0); with neither it explores arm by arm (0.88-0.89)
    assert mean["default"] >= 0.95 and mean["conservative alone"] >= 0.95
    assert mean["neither"] <= 0.90


def test_sibling_estimates_count_rounds_that_drafted_short_as_keeping_nothing_further():
    from autotune.rewards.siblings import sibling_rewards
    from engine import GenerationMetrics

    # A hybrid at K=4, 100 rounds: 50 by its model (kept 40, 30, 20, 10 at positions 1-4) and 50
    # lookups of a 2-token match, both kept. Per round: 3.0 tokens at K=4, 2.7 at K=2. Per drafted
    # position the deep ones (20 of 50, 10 of 50) look kept as often as in the model's rounds,
    # which makes K=4 look 3.3 tokens a round and K=2 worse than it is.
    m = GenerationMetrics(new_tokens=301, rounds=100, drafted=300, accepted=200, draft_steps=300, draft_s=0.3,
                          verify_s=1.0, drafted_per_position=[100, 100, 50, 50], accepted_per_position=[90, 80, 20, 10])
    est = sibling_rewards(m, Arm("hybrid", 4), 2.0, ks=[2, 4])
    step = 0.3 / 300  # a draft step, as this request measured it
    assert est["hybrid:2"][0] == pytest.approx(2.0 * (2.7 / (2 * step + 0.01)) / (3.0 / (4 * step + 0.01)))


@pytest.mark.parametrize("name", ["ucb", "thompson", "contextual"])
def test_resumes_from_saved_state_without_re_exploring(name):
    policy = make_policy(name, ARMS)
    simulate(policy, means_with_best("small:2"), 300)
    saved = json.loads(json.dumps(policy.state_dict()))  # as the store keeps it
    resumed = make_policy(name, ARMS)
    resumed.load_state_dict(saved)
    chosen = simulate(resumed, means_with_best("small:2"), 30, seed=5)
    assert Counter(chosen)["small:2"] >= 25


def assert_decisions_see_the_other_keys_as_they_are(policy, contexts):
    for context in contexts:
        table = policy.table(context)
        load = context.key.partition("@")[2]
        others = [t for k, t in policy.tables.items() if k != context.key and k.partition("@")[2] == load]
        view = policy._with_shared_prior(context, table)
        for arm in policy.arm_names:
            n = sum(t.rows[arm][0] for t in others)
            if n < 1e-9:
                assert view.rows[arm] == table.rows[arm]
                continue
            raw = sum(t.rows[arm][1] for t in others) / n
            # as the level model (fitted when the totals were last summed afresh) predicts it for this
            # key, or the arm's effect here with the class's affinity for its drafter at another load
            mean = (policy._load_totals(load).leveled(table, {arm: raw}) | policy._carried(context, table))[arm]
            share = min(policy.share_weight, n)  # never more than the others' own evidence
            weight = share ** 2 / (share + table.n(arm))
            variance = sum(t.pooled_variance() for t in others) / len(others)
            assert view.rows[arm][0] == pytest.approx(table.rows[arm][0] + weight)
            assert view.rows[arm][1] == pytest.approx(table.rows[arm][1] + weight * mean)
            assert view.rows[arm][2] == pytest.approx(table.rows[arm][2] + weight * (mean * mean + variance))


def test_a_decision_sees_the_other_keys_at_its_load_as_they_are_now():
    """Decisions subtract their own key from per-load totals built at update time; whatever the
    order of updates, new keys and a restore, that must equal summing the other keys afresh."""
    policy = make_policy("ucb", ARMS)
    rng = random.Random(3)
    contexts = [Context(c, load) for c in ("code", "docs", "edit") for load in (1, 3, 9)]
    for step in range(120):
        context = rng.choice(contexts[: 3 + step // 20])  # keys join as the stream goes on
        arm = policy.choose(context)
        siblings = {"small:8": (rng.uniform(0.8, 1.6), 0.5)} if arm == Arm("small", 2) else {}
        policy.update(context, arm, Outcome(100.0, rng.uniform(0.6, 1.6), siblings=siblings))
        if step == 40:
            saved = json.loads(json.dumps(policy.state_dict()))
        if step == 80:
            policy.load_state_dict(saved)  # rewound to an older store
            assert_decisions_see_the_other_keys_as_they_are(policy, contexts[:7])
    assert_decisions_see_the_other_keys_as_they_are(policy, contexts)  # the last one is new here


def test_a_new_class_takes_no_more_pseudo_observations_of_an_arm_than_the_other_classes_measured():
    """What other classes measured enters a decision only (`_with_shared_prior`), never the new
    key's own table, where it would outweigh the key's first replays for many requests."""
    policy = make_policy("ucb", ARMS)
    policy.update(Context("a"), Arm("small", 8), Outcome(100.0, 1.4))  # one request, then ten elsewhere
    for _ in range(10):
        policy.update(Context("a"), Arm("small", 2), Outcome(100.0, 1.2))
    table = policy.table(Context("b"))
    assert all(table.n(arm) == 0.0 for arm in table.rows)
    view = policy._with_shared_prior(Context("b"), table)
    assert view.n("small:8") == pytest.approx(0.99 ** 10) and view.mean("small:8") > view.mean("small:2")
    assert view.n("small:2") == pytest.approx(policy.share_weight) and view.n("small:1") == 0.0


def test_an_arm_measured_only_where_speculation_goes_less_far_is_not_taken_for_a_slow_arm_elsewhere():
    """Classes share each arm's effect over their own level (`fit_levels`), not its raw mean: an
    arm played only in markup (1.2x OFF, where a lookup replayed beside it made 1.0x) would
    otherwise look slower everywhere than one played only in docs (1.9x, the lookup 1.6x)."""
    names = [str(a) for a in [OFF, *ARMS]]
    markup, docs = ArmTable(names), ArmTable(names)
    for _ in range(20):
        markup.update("small:2", 1.2, 0.99, siblings={"ngram:3": (1.0, 0.5), "off": (1.0, 0.5)})
        docs.update("small:4", 1.9, 0.99, siblings={"ngram:3": (1.6, 0.5), "off": (1.0, 0.5)})
    totals = LoadTotals([markup, docs], names)
    like_docs = ArmTable(names)
    like_docs.update("ngram:3", 1.6, 1.0)
    predicted = totals.leveled(like_docs, {"small:2": 1.2, "small:4": 1.9, "off": 1.0})
    # Each ran 1.2x its class's lookup: alike over a docs-like level, far above small:2's raw mean.
    assert predicted["small:2"] == pytest.approx(predicted["small:4"], rel=0.02)
    assert predicted["small:2"] > 1.2 * 1.4 and predicted["off"] == 1.0
    unseen = totals.leveled(ArmTable(names), {"small:2": 1.2, "small:4": 1.9})  # a new class: the mean level
    assert unseen["small:2"] / unseen["small:4"] == pytest.approx(1.2 * 1.6 / 1.9, rel=0.01)


@pytest.mark.parametrize("name", ["ucb", "thompson", "contextual"])
def test_a_new_class_starts_from_pooled_statistics(name):
    """Tenants that resemble each other: a class seen for the first time plays the arm the
    others found best from its first request, not OFF nor an arm to explore."""
    policy = make_policy(name, ARMS)
    simulate(policy, means_with_best("small:8"), 200, context=Context("code"))
    simulate(policy, means_with_best("small:8"), 200, context=Context("docs"))
    chosen = simulate(policy, means_with_best("small:8"), 12, context=Context("new"))
    assert chosen[0] == "small:8"
    assert Counter(chosen)["small:8"] >= 10


@pytest.mark.parametrize("name", ["ucb", "thompson"])
def test_a_new_class_serves_its_first_request_on_the_arm_most_likely_to_win(name):
    """Not on the arm the others know least (UCB's bonus for the one K only an estimate has
    touched), and a fresh policy tries a drafter before OFF, whose reward is 1 by definition."""
    policy = make_policy(name, [OFF, *ARMS])
    assert str(policy.choose(CODE)) == "small:4"  # the first drafter's middle K, not OFF
    rng = random.Random(0)
    for cls in ("code", "docs"):
        for _ in range(20):
            for arm, mean in (("small:8", 1.6), ("small:4", 1.3), ("ngram:3", 1.1), ("small:2", 1.2)):
                estimate = {"small:1": (1.4, 0.01)} if arm == "small:2" else {}
                policy.update(Context(cls), Arm.parse(arm), Outcome(goodput=100, reward=rng.gauss(mean, 0.2),
                                                                    siblings=estimate))
    assert str(policy.choose(Context("new"))) == "small:8"


@pytest.mark.parametrize("name", ["ucb", "thompson"])
def test_a_stream_of_new_classes_is_seeded_from_every_class_before_it_not_the_first(name):
    """Many tenants, each met once before the next: the first class's one request favoured
    small:2; every later one measured small:8 far faster. A new class then starts on small:8,
    though every update so far was a new key's first (the shared fit must follow them)."""
    policy = make_policy(name, [OFF, *ARMS])
    first = {"small:1": (1.1, 1.0), "small:2": (1.3, 1.0), "small:8": (1.1, 1.0), "ngram:3": (1.0, 1.0)}
    policy.update(Context("tenant-0"), Arm.parse("small:4"), Outcome(goodput=100, reward=1.2, siblings=first))
    later = {"small:1": (1.1, 1.0), "small:2": (1.2, 1.0), "small:8": (2.2, 1.0), "ngram:3": (1.0, 1.0)}
    for i in range(1, 6):
        policy.choose(Context(f"tenant-{i}"))
        policy.update(Context(f"tenant-{i}"), Arm.parse("small:4"), Outcome(goodput=100, reward=1.6, siblings=later))
    assert str(policy.choose(Context("tenant-new"))) == "small:8"


@pytest.mark.parametrize("name", ["thompson", "contextual"])
def test_thompson_serves_the_arm_its_evidence_favours_among_many_arms_with_little_evidence(name):
    """A class's third request on the many-classes bench: 40 arms, each replayed twice (the
    prompts' noise, +-0.2), one clearly best by that evidence. A draw from the full posterior
    of each (sd 0.14) has the highest of 39 equal arms beat the best about half the time
    (thompson played 23-24 arms in 104 requests there, and served chat on model drafters at
    0.88x OFF)."""
    arms = [Arm(drafter, k) for drafter in ("small", "medium", "distilled", "ngram") for k in range(1, 11)]
    means = {str(a): 1.2 for a in arms} | {"small:4": 1.5}
    chosen = Counter()
    for seed in range(10):
        policy = make_policy(name, [OFF, *arms], seed=seed)
        for noise in (0.2, -0.2):
            replays = {a: (mean + noise, 1.0) for a, mean in means.items()}
            policy.update(CODE, OFF, Outcome(goodput=100, reward=1.0, siblings=replays))
        chosen.update(str(policy.choose(CODE)) for _ in range(20))
    assert chosen["small:4"] >= 160, chosen.most_common(5)  # of 200


def test_learns_a_different_best_arm_under_load():
    policy = make_policy("thompson", ARMS)
    alone, busy = Context("code", load=1), Context("code", load=8)
    for round_ in range(300):
        simulate(policy, means_with_best("small:8"), 1, context=alone, seed=round_)
        simulate(policy, means_with_best("small:1"), 1, context=busy, seed=10_000 + round_)
    assert Counter(simulate(policy, means_with_best("small:8"), 50, context=alone))["small:8"] >= 40
    assert Counter(simulate(policy, means_with_best("small:1"), 50, context=busy))["small:1"] >= 40


def test_a_class_new_at_a_load_starts_from_other_classes_at_that_load():
    policy = make_policy("ucb", ARMS)
    simulate(policy, means_with_best("small:8"), 200, context=Context("code", load=1))
    simulate(policy, means_with_best("small:1"), 200, context=Context("docs", load=8))
    chosen = simulate(policy, means_with_best("small:1"), 12, context=Context("code", load=8))
    assert chosen[:3] == ["small:1"] * 3  # from docs at load 8, not code@load1's small:8


@pytest.mark.parametrize("name", ["ucb", "thompson"])
def test_after_losses_a_key_plays_an_arm_confidently_faster_than_off_rather_than_off(name):
    """Two losing plays leave the margin negative; replays of them say small:2 would have won.
    Untried arms are then unaffordable, but small:2 is safer than OFF, so it is played."""
    policy = make_policy(name, ARMS)
    key = Context("creative")
    policy.update(key, OFF, Outcome(goodput=100, reward=1.0))
    for _ in range(2):
        policy.update(key, Arm("ngram", 3), Outcome(goodput=60, reward=0.6, siblings={"small:2": (1.4, 0.5)}))
    assert policy.table(key).margin < 0
    assert [str(policy.choose(key)) for _ in range(5)] == ["small:2"] * 5
    if name == "ucb":  # unconstrained, it would explore an untried arm first: its drafter's middle untried K
        unconstrained = make_policy(name, ARMS, safety=None)
        unconstrained.load_state_dict(json.loads(json.dumps(policy.state_dict())))
        assert str(unconstrained.choose(key)) == "small:4"  # of small:1, 4, 8 (small:2 has an estimate)


@pytest.mark.parametrize("name", ["ucb", "thompson"])
def test_after_a_lost_first_request_a_key_plays_what_its_replays_found_though_others_found_it_slow(name):
    """Structured markup on the committed family: other classes favour one arm (the code head's
    hybrid) and find another slow (the prose head); a new class's first request plays the first
    and loses, and its replays find the second at 1.4x. What is safe to play is the key's own
    evidence; shrunk toward the others', the prose head's bound stayed under OFF, and conservative
    exploration, repaying the loss at `safety` a request, held the class at OFF for good."""
    policy = make_policy(name, ARMS)
    slow = {str(a): (0.7, 1.0) for a in ARMS if a.drafter == "small"}  # the others' replays of the small drafter
    for cls in ("code", "docs", "edit"):
        for _ in range(12):
            policy.update(Context(cls), Arm("ngram", 3), Outcome(goodput=150, reward=1.5, siblings=slow))
    key = Context("structured")
    first = policy.choose(key)
    assert str(first) == "ngram:3"  # what the others' evidence favours
    policy.update(key, first, Outcome(goodput=40, reward=0.4, siblings={"small:2": (1.4, 1.0)}))
    assert policy.table(key).margin < 0
    means = {**{str(a): 0.7 for a in ARMS}, "ngram:3": 0.4, "small:2": 1.4, "off": 1.0}
    chosen = Counter(simulate(policy, means, 7, context=key, noise=0.1))  # the class's other seven requests
    assert chosen["small:2"] >= 4, chosen  # held at OFF for all seven before


def trained_on_overlap():
    """A contextual policy after 400 requests of four classes where ngram:3 pays only on
    repetitive prompts (reward 0.6 + 1.2 x n-gram overlap) and small:2 pays 1.3 everywhere."""
    policy = make_policy("contextual", ARMS)
    rng = random.Random(0)
    for i in range(400):
        overlap = rng.random()
        ctx = Context(f"class{i % 4}", features={"ngram_overlap": overlap})
        arm = policy.choose(ctx)
        mean = {"ngram:3": 0.6 + 1.2 * overlap, "small:2": 1.3, "off": 1.0}.get(str(arm), 0.9)
        reward = rng.gauss(mean, 0.1)
        # As the controller's replays would: an estimate of ngram:3 from every request.
        siblings = {"ngram:3": (0.6 + 1.2 * overlap, 0.5)} if str(arm) != "ngram:3" else {}
        policy.update(ctx, arm, Outcome(goodput=reward * 100, reward=reward, siblings=siblings))
    return policy


def test_contextual_policy_uses_features_for_a_class_it_has_not_seen():
    policy = trained_on_overlap()
    repetitive, varied = (Context("unseen", features={"ngram_overlap": o}) for o in (0.95, 0.05))
    policy.update(repetitive, OFF, Outcome(goodput=100, reward=1.0))  # its baseline
    assert Counter(str(policy.choose(repetitive)) for _ in range(100))["ngram:3"] >= 85  # 96 % measured
    assert Counter(str(policy.choose(varied)) for _ in range(100))["small:2"] >= 80  # 91 %, else OFF
    # thompson, with the same history, can only pool the classes: one arm whatever the prompt
    pooled = make_policy("thompson", ARMS)
    pooled.load_state_dict({k: v for k, v in policy.state_dict().items() if k.startswith("class")})
    pooled.update(repetitive, OFF, Outcome(goodput=100, reward=1.0))
    assert Counter(str(pooled.choose(repetitive)) for _ in range(100))["ngram:3"] < 50


def test_contextual_history_saved_before_a_feature_was_added_loads_with_it_as_zero():
    from policies.contextual import FEATURES, HISTORY_KEY

    state = json.loads(json.dumps(trained_on_overlap().state_dict()))
    for row in state[HISTORY_KEY]["history"]:
        row[0] = row[0][:-1]  # as saved before edits_logits joined the features
    policy = make_policy("contextual", ARMS)
    policy.load_state_dict(state)
    assert {len(x) for x, *_ in policy.history} == {len(FEATURES)} and policy.lines is not None
    repetitive = Context("unseen", features={"ngram_overlap": 0.95})
    policy.update(repetitive, OFF, Outcome(goodput=100, reward=1.0))
    assert Counter(str(policy.choose(repetitive)) for _ in range(100))["ngram:3"] >= 85


def test_contextual_policy_follows_a_class_whose_own_rewards_contradict_its_features():
    """The feature model is a prior, not a phase: a class where n-gram lookup loses despite
    repetitive prompts leaves ngram:3 within a few requests (it used to play the model's
    guess for its first 20, which a class seen only in bursts never got past)."""
    policy = trained_on_overlap()
    liar = Context("liar", features={"ngram_overlap": 0.95})
    means = {str(a): 0.9 for a in ARMS} | {"off": 1.0, "ngram:3": 0.7, "small:2": 1.3}
    chosen = simulate(policy, means, 16, context=liar, noise=0.1)
    assert chosen[0] == "ngram:3"  # the features' pick first
    assert "small:2" in chosen[1:3]  # left after a loss or two
    assert Counter(chosen[1:8])["small:2"] >= 5
    assert Counter(chosen[-8:])["ngram:3"] <= 1  # at most a probe since


def test_contextual_policy_fits_each_arm_as_its_own_ridge_line_in_one_fit():
    """The one block-sparse fit must give each arm the line a separate fit on its rows gives."""
    import numpy as np
    from sklearn.linear_model import Ridge

    from policies.contextual import feature_vector

    rng = random.Random(4)
    policy = make_policy("contextual", ARMS, refit_every=10_000)
    for _ in range(90):
        features = {"prompt_tokens": rng.randint(10, 400), "ngram_overlap": rng.random(),
                    "temperature": rng.choice([0.0, 0.7, 1.0])}
        arm = rng.choice(ARMS[:3])
        reward = 0.8 + ARMS.index(arm) * 0.1 + 0.4 * features["ngram_overlap"] + rng.gauss(0, 0.1)
        siblings = {"ngram:3": (1.0 - 0.3 * features["ngram_overlap"], 0.5)}  # weighted rows
        policy.update(Context("code", rng.choice([1, 3]), features), arm, Outcome(100.0, reward, siblings=siblings))
    policy.refit()
    X = np.asarray([h[0] for h in policy.history])
    scaled = (X - X.mean(0)) / (X.std(0) + 1e-6)
    probe = Context("new", 2, {"prompt_tokens": 250, "ngram_overlap": 0.3, "temperature": 0.7})
    x = (np.asarray(feature_vector(probe)) - X.mean(0)) / (X.std(0) + 1e-6)
    predicted = policy._shared_means(probe, {})
    assert set(predicted) == {"small:1", "small:2", "small:4", "ngram:3"}
    for arm, mean in predicted.items():
        rows = [i for i, h in enumerate(policy.history) if h[1] == arm]
        y = np.asarray([policy.history[i][2] for i in rows])
        alone = Ridge(alpha=1.0).fit(scaled[rows], y, sample_weight=[policy.history[i][3] for i in rows])
        line = float(alone.predict(x[None])[0])
        assert y.min() < line < y.max()  # not clipped: the lines themselves are compared
        assert mean == pytest.approx(line, abs=1e-6)


def test_static_heuristic_and_unknown_policies():
    assert make_policy("static", ARMS, arm="small:4").choose(Context("x")) == Arm("small", 4)
    assert make_policy("off", ARMS).choose(Context("x")) == OFF
    heuristic = make_policy("heuristic", ARMS, arm="small:2")
    assert heuristic.schedule(Context("x"), Arm("small", 2)).next_k(2, 2, 2) == 4
    with pytest.raises(PolicyError, match="unknown policy 'bandit'; choose one of"):
        make_policy("bandit", ARMS)


def test_sibling_estimates_follow_the_speculation_model():
    from autotune.rewards.siblings import sibling_rewards
    from engine import GenerationMetrics

    # 100 rounds at K=4: drafts cost 1 ms each, a verify 10 ms; survival 0.8, 0.6, 0.4, 0.2.
    m = GenerationMetrics(new_tokens=301, rounds=100, drafted=400, accepted=200, draft_steps=400, draft_s=0.4,
                          verify_s=1.0, drafted_per_position=[100] * 4, accepted_per_position=[80, 60, 40, 20])
    est = sibling_rewards(m, Arm("small", 4), 2.0, ks=[1, 2, 4, 8])
    rate = {1: 1.8 / 0.011, 2: 2.4 / 0.012, 4: 3.0 / 0.014, 8: (3.0 + 0.1 + 0.05 + 0.025 + 0.0125) / 0.018}
    assert set(est) == {"small:1", "small:2", "small:8"}
    for k in (1, 2, 8):
        assert est[f"small:{k}"][0] == pytest.approx(2.0 * rate[k] / rate[4])
    assert est["small:1"][1] == 0.5 and est["small:8"][1] == 0.25  # extrapolation weighs less
    # With the cost model's round cost (a first step dearer than the rest), scaled to this
    # request's 4 ms rounds: 2.5 ms modelled at K=4, so 1.6 x 1 ms at K=1 and 1.6 x 4.5 ms at K=8.
    m.draft_rounds = 100
    est = sibling_rewards(m, Arm("small", 4), 2.0, ks=[1, 8], round_cost=lambda k: 0.5e-3 * (1 + k))
    rate.update({1: 1.8 / 0.0116, 8: (3.0 + 0.1 + 0.05 + 0.025 + 0.0125) / 0.0172})
    for k in (1, 8):
        assert est[f"small:{k}"][0] == pytest.approx(2.0 * rate[k] / rate[4])
    # A verify grows with its tokens (the cost model's 8 + n ms, this request's 10 ms at 5 tokens):
    # at K=8 a round verifies 9 tokens, 10 x 17/13 ms; at K=1 2 tokens, 10 x 10/13 ms. A round
    # that drafted fewer (a lookup's short match) verifies as many at K=8 and at most 2 at K=1.
    m.verify_by_width = {5: [0.8, 80], 3: [0.2, 20]}
    est = sibling_rewards(m, Arm("small", 4), 2.0, ks=[1, 8], round_cost=lambda k: 0.5e-3 * (1 + k),
                          verify_cost=lambda n: 1e-3 * (8 + n))
    modelled = {4: 80 * 13 + 20 * 11, 1: 100 * 10, 8: 80 * 17 + 20 * 11}
    verify = {k: 0.010 * modelled[k] / modelled[4] for k in (1, 4, 8)}
    draft = {1: 1.6e-3, 4: 4e-3, 8: 7.2e-3}
    tokens = {1: 1.8, 4: 3.0, 8: 3.0 + 0.1 + 0.05 + 0.025 + 0.0125}
    for k in (1, 8):
        expected = 2.0 * (tokens[k] / (draft[k] + verify[k])) / (tokens[4] / (draft[4] + verify[4]))
        assert est[f"small:{k}"][0] == pytest.approx(expected)
    assert est["small:8"][0] < 2.0 * rate[8] / rate[4]  # below the estimate of a verify that costs the same
    assert sibling_rewards(m, OFF, 1.0, ks=[1, 2]) == {}


@pytest.mark.parametrize("name", ["ucb", "thompson", "contextual"])
def test_only_arms_that_could_still_win_are_worth_replaying(name):
    """A replay costs a forward per drafter model: an arm every class has found far slower is left
    out, in a new class too (what the others learned), while arms without evidence stay in."""
    policy = make_policy(name, ARMS)
    rng = random.Random(0)
    for request_class in ("code", "docs"):
        for _ in range(20):
            for arm, mean in ((Arm("small", 4), 1.5), (Arm("small", 8), 0.6)):
                policy.update(Context(request_class), arm, Outcome(100.0, mean + rng.gauss(0, 0.05)))
    for request_class in ("code", "chat"):
        worth = policy.worth_replaying(Context(request_class))
        assert OFF in worth and Arm("small", 4) in worth and Arm("ngram", 3) in worth
        assert Arm("small", 8) not in worth


def test_a_class_whose_own_evidence_disagrees_with_the_others_follows_its_own():
    """Arms best elsewhere but worse than OFF here (n-gram lookup on text sampled at T=1) must give
    way to the class's own measurements, not stay propped up by the other classes' means."""
    arms = [Arm("ngram", k) for k in (1, 2, 3, 4, 6, 8)] + [Arm("small", k) for k in (1, 2, 3)]
    ngram, small = [str(a) for a in arms if a.drafter == "ngram"], [str(a) for a in arms if a.drafter == "small"]
    elsewhere = {"off": 1.0, **dict.fromkeys(ngram, 1.5), **dict.fromkeys(small, 1.2)}
    here = {"off": 1.0, **dict.fromkeys(ngram, 0.9), **dict.fromkeys(small, 1.25)}
    wrong = 0
    for seed in range(5):
        policy = make_policy("ucb", arms)
        for name in ("code", "docs", "edit"):
            simulate(policy, elsewhere, 60, context=Context(name), seed=seed)
        chosen = simulate(policy, here, 100, context=Context("creative"), seed=100 + seed)
        wrong += sum(a.startswith("ngram") for a in chosen[20:])
    assert wrong <= 85  # of 400 plays; a fixed share of 2 pseudo-observations per arm gave 105


@pytest.mark.parametrize("name", ["ucb", "thompson"])
def test_a_class_new_at_a_load_carries_what_its_text_favours_there_from_another_load(name):
    """Mean reward as the class's text (which drafter drafts it well) times what the load does
    to each arm (large K lose in batches). Code and docs favour different drafters alone; docs
    is known under load too. Code's first plays under load take the drafter its own text
    favours at the K the load favours, not docs' favourite under load."""
    load_effect = {1: {"small:1": 0.0, "small:2": 0.2, "small:4": 0.35, "small:8": 0.45, "ngram:3": 0.3},
                   8: {"small:1": 0.05, "small:2": 0.15, "small:4": 0.0, "small:8": -0.3, "ngram:3": 0.15}}
    text = {"code": {"small": 0.2, "ngram": -0.2}, "docs": {"small": -0.2, "ngram": 0.2}}

    def means(cls: str, load: int) -> dict[str, float]:
        return {"off": 1.0} | {a: math.exp(e + text[cls][Arm.parse(a).drafter]) for a, e in load_effect[load].items()}

    policy, rng = make_policy(name, ARMS), random.Random(0)
    for cls, load in (("code", 1), ("docs", 1), ("docs", 8)):
        context, truth = Context(cls, load=load), means(cls, load)
        for _ in range(12):  # each request replayed on the other arms, as the controller does a key's first
            arm = policy.choose(context)
            replays = {a: (rng.gauss(m, 0.1), 1.0) for a, m in truth.items() if a != str(arm)}
            policy.update(context, arm, Outcome(goodput=100, reward=rng.gauss(truth[str(arm)], 0.1), siblings=replays))
    first = simulate(policy, means("code", 8), 5, context=Context("code", load=8), noise=0.1)
    assert first[0] == "small:2" and Counter(first)["small:2"] >= 4  # code@8's best (1.42x); docs@8's: ngram:3


@pytest.mark.parametrize("name", ["ucb", "thompson"])
def test_one_hard_request_alone_does_not_make_other_classes_bursts_look_fast(name):
    """Two classes alike: one served alone once, on a hard prompt (every arm 0.7x its mean), then
    in bursts; the other served alone often. Under load every arm loses to OFF for both. The
    second class's first bursts must not take the first one's burst rewards over its one hard
    request as what the load does: taken so, they priced every arm 1.4x too high, and the
    second class's bursts went to speculation."""
    alone = {"small:1": 0.1, "small:2": 0.25, "small:4": 0.35, "small:8": 0.4, "ngram:3": 0.2}
    busy = {"small:1": -0.2, "small:2": -0.2, "small:4": -0.3, "small:8": -0.5, "ngram:3": -0.25}
    policy, rng = make_policy(name, ARMS), random.Random(0)

    def serve(context, effects, requests, scale=1.0):
        truth = {"off": 1.0} | {a: scale * math.exp(e) for a, e in effects.items()}
        for _ in range(requests):  # each request replayed on the other arms, as the controller does
            arm = policy.choose(context)
            replays = {a: (rng.gauss(m, 0.05), 1.0) for a, m in truth.items() if a != str(arm)}
            policy.update(context, arm, Outcome(goodput=100, reward=rng.gauss(truth[str(arm)], 0.05),
                                                siblings=replays))

    serve(Context("chat", load=1), alone, 12)
    serve(Context("markup", load=1), alone, 1, scale=0.7)
    serve(Context("markup", load=16), busy, 6)
    first = simulate(policy, {"off": 1.0} | {a: math.exp(e) for a, e in busy.items()}, 3,
                     context=Context("chat", load=16), noise=0.05)
    assert first == ["off"] * 3


@pytest.mark.parametrize("name", ["ucb", "thompson"])
def test_an_arm_one_class_alone_measured_is_not_priced_as_fast_for_every_class(name):
    """Under load only structured markup's bursts had replayed the prose model drafter, which
    drafts its text well. Its effect over the mean arm, fitted from that one class, carried the
    class's affinity, and the code and creative classes' first bursts played it at 0.68-0.70x
    OFF. Here eight classes never replayed the lookup; one did, where it ran a little faster
    than every other arm; a new class, where the lookup loses, must not begin with it."""
    shape = {"small:1": -0.1, "small:2": 0.05, "small:4": 0.15, "small:8": 0.0}
    policy, rng = make_policy(name, ARMS), random.Random(0)

    def serve(context, truth):
        for _ in range(4):  # served on small:4, replayed on the arms `truth` names
            replays = {a: (rng.gauss(m, 0.02), 1.0) for a, m in truth.items() if a != "small:4"}
            policy.update(context, Arm("small", 4), Outcome(100, rng.gauss(truth["small:4"], 0.02), siblings=replays))

    for i in range(8):
        serve(Context(f"class{i}", load=16), {"off": 1.0} | {a: math.exp(0.05 * i + e) for a, e in shape.items()})
    lookup_favoured = {"off": 1.0, "ngram:3": math.exp(0.22)} | {a: math.exp(e) for a, e in shape.items()}
    serve(Context("markup", load=16), lookup_favoured)
    first = simulate(policy, {"off": 1.0, "ngram:3": 0.7} | {a: math.exp(0.3 + e) for a, e in shape.items()}, 3,
                     context=Context("code", load=16), noise=0.02)
    assert "ngram:3" not in first
