"""The controller end to end on tiny random models: serve, measure, learn, persist, resume."""

import threading
import time

import pytest
import torch
from conftest import tiny_qwen3_next

from autotune.control.classifier import RequestClassifier
from autotune.control.coalesce import Batch
from autotune.control.controller import AutotuneController, PendingRequest
from autotune.rewards.costs import NO_MODEL
from autotune.rewards.reward import RewardModel
from engine import MAX_K, OFF, Arm, HybridDrafter, InvalidRequestError, NGramDrafter, SamplingParams, SpeculativeEngine
from policies import Context, Policy, PolicyError
from store import Store


@pytest.fixture(scope="module")
def engine(target, draft_model):
    return SpeculativeEngine(target, {"small": draft_model, "ngram": NGramDrafter()})


def hf_greedy(model, prompt, n):
    ids = torch.tensor([prompt])
    return model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                          pad_token_id=0)[0, len(prompt):].tolist()


PROMPTS = [[(7 * i + j) % 64 for j in range(6 + i % 5)] for i in range(12)]


def run_in_threads(worker, n: int) -> None:
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def test_serves_learns_and_records_every_request(engine, target, tmp_path):
    url = f"sqlite:///{tmp_path / 'c.db'}"
    arms = [OFF, Arm("small", 2), Arm("ngram", 3)]
    with Store(url) as store, AutotuneController(engine, store, policy="thompson", arms=arms) as ctl:
        # every third sampled from its top token only: still the target's greedy output
        results = [ctl.generate(p, request_class="code" if i % 2 else "docs", max_new_tokens=12,
                                **({"temperature": 1.0, "top_k": 1, "seed": i} if i % 3 == 0 else {}))
                   for i, p in enumerate(PROMPTS)]
        ctl.generate(PROMPTS[0], request_class="code", max_new_tokens=4, repetition_penalty=1.3)
        ctl.close()
        assert store.count() == len(PROMPTS) + 1
        rows = store.observations()
    for p, r in zip(PROMPTS, results):
        assert r.tokens == hf_greedy(target, p, 12)  # whatever arm was chosen, output is the target's
        assert r.gpu_util is None and r.gpu_mem_mb is None  # no NVIDIA GPU here: unavailable, no error
    assert {r["request_class"] for r in rows} == {"code", "docs"}
    # calibration priced OFF: the first request tries a drafter, whose reward is priced in OFF's terms
    assert rows[0]["arm"] == "small:2" and 0 < rows[0]["reward"] <= 3 + 1e-9
    assert all(r["goodput"] > 0 and r["features"]["prompt_tokens"] > 0 for r in rows)
    assert [r["features"]["edits_logits"] for r in rows] == [0.0] * len(PROMPTS) + [1.0]  # the penalized one


def test_a_batch_is_served_learned_and_recorded_under_its_load(engine, target, tmp_path):
    url = f"sqlite:///{tmp_path / 'b.db'}"
    arms = [OFF, Arm("small", 2), Arm("ngram", 3)]
    with Store(url) as store, AutotuneController(engine, store, policy="ucb", arms=arms,
                                                 min_baseline_steps=8) as ctl:
        # the last sampled from the tokens as likely as the top one: still greedy
        batches = [ctl.generate_batch(PROMPTS[i:i + 6], "code", max_new_tokens=10,
                                      **({"temperature": 1.0, "min_p": 1.0} if n == 3 else {}))
                   for n, i in enumerate((0, 6, 0, 6))]
        alone = ctl.generate(PROMPTS[0], "code", max_new_tokens=10)
        ctl.close()
        rows = store.observations()
    for i, batch in zip((0, 6, 0, 6), batches):
        assert [r.tokens for r in batch] == [hf_greedy(target, p, 10) for p in PROMPTS[i:i + 6]]
        assert {r.load for r in batch} == {6}
    # no OFF baseline first: a batch on a drafter runs OFF rounds among its own to price them
    assert str(batches[0][0].arm) != "off" and batches[0][0].metrics.probe_rounds == 2
    assert rows[0]["probe_rounds"] == 2 and 0 < rows[0]["reward"] <= 3 + 1e-9
    state = ctl.policy.state_dict()
    assert "code@load5+" in state and "code@load1" in state  # learned apart: costs differ by load
    assert set(ctl.rewards.costs) == {"1", "1 sampled", "5+", "5+ sampled"} and alone.load == 1  # by load and sampling
    assert len(rows) == 25 and sorted({r["load"] for r in rows}) == [1, 6]


def test_a_restarted_controller_resumes_where_it_stopped(engine, tmp_path):
    url = f"sqlite:///{tmp_path / 'r.db'}"
    arms = [OFF, Arm("small", 2), Arm("ngram", 3)]
    with Store(url) as store:
        ctl = AutotuneController(engine, store, policy="ucb", arms=arms, save_every=5)
        for p in PROMPTS:
            ctl.generate(p, request_class="code", max_new_tokens=8)
        ctl.close()
        before = ctl.policy.state_dict()
    with Store(url) as store:
        resumed = AutotuneController(engine, store, policy="ucb", arms=arms)
        assert resumed.policy.state_dict() == before
        # and the measured costs: rewards and replays price arms as before the restart
        assert {b: c.state_dict() for b, c in resumed.rewards.costs.items()} == {b: c.state_dict()
                                                                         for b, c in ctl.rewards.costs.items()}
        assert set(resumed.rewards.costs) == {"1", "1 sampled"} and resumed.rewards.costs["1"].off_step() > 0
        # calibrated side by side with OFF, each drafter at every K of its arms
        assert {d: set(ks) for d, ks in resumed.rewards.costs["1"].relative_draft.items()} == {"small": {2},
                                                                                              "ngram": {3}}
        assert resumed.others.served == ctl.others.served  # nor replaying counterfactuals again from the start
        # No re-exploration: the first choice is not the OFF baseline nor an untried arm.
        assert resumed.policy.choose(Context("code")) == ctl.policy.choose(Context("code"))


def test_a_store_that_cannot_save_now_fails_no_request_and_is_written_later(engine, tmp_path, monkeypatch):
    """A save comes due inside a request's update; a store locked past its timeout (or a database
    server gone) fails no request: what was learned stays pending, and the next save that works
    writes it."""
    from sqlalchemy.exc import OperationalError

    def locked(*args, **kwargs):
        raise OperationalError("INSERT", {}, Exception("database is locked"))

    with Store(f"sqlite:///{tmp_path / 'busy.db'}") as store:
        ctl = AutotuneController(engine, store, policy="ucb", arms=[OFF, Arm("ngram", 3)], save_every=1)
        with monkeypatch.context() as busy:
            busy.setattr(store, "save_policy_states", locked)
            results = [ctl.generate(p, request_class="code", max_new_tokens=8) for p in PROMPTS[:3]]
            with pytest.raises(OperationalError):
                ctl.save()  # an explicit save says the database refused it
            assert store.load_policy_states("ucb") == {}
        assert [len(r.tokens) for r in results] == [8, 8, 8]
        ctl.close()
        assert store.load_policy_states("ucb")["code@load1"] == ctl.policy.state_dict()["code@load1"]


def test_a_save_that_hangs_delays_no_request(engine, tmp_path, monkeypatch):
    """Saves run off the request path: while one is stuck in the database (another process holding
    its lock), requests whose updates come due are served and learned from, and the state they
    taught is written once the database answers."""
    started, release = threading.Event(), threading.Event()
    with Store(f"sqlite:///{tmp_path / 'slow.db'}") as store:
        save = store.save_policy_states

        def stuck(states):
            started.set()
            release.wait(60)
            save(states)

        monkeypatch.setattr(store, "save_policy_states", stuck)
        ctl = AutotuneController(engine, store, policy="ucb", arms=[OFF, Arm("ngram", 3)], save_every=1)
        results = [ctl.generate(p, request_class="code", max_new_tokens=8) for p in PROMPTS[:4]]
        assert started.is_set() and not release.is_set()  # served while the first save hangs
        assert [len(r.tokens) for r in results] == [8] * 4
        release.set()
        ctl.close()
        assert store.load_policy_states("ucb")["code@load1"] == ctl.policy.state_dict()["code@load1"]


def test_a_store_whose_costs_were_not_measured_side_by_side_is_calibrated_again(engine, tmp_path):
    """Costs saved before calibration paired each drafter with OFF keep what requests measured
    and gain the side-by-side costs, instead of pricing every reward by a ratio of medians."""
    url = f"sqlite:///{tmp_path / 'old.db'}"
    arms = [OFF, Arm("small", 2), Arm("ngram", 3)]
    with Store(url) as store:
        ctl = AutotuneController(engine, store, policy="ucb", arms=arms)
        ctl.generate(PROMPTS[0], request_class="code", max_new_tokens=8)
        ctl.close()
        old = {key: {k: v for k, v in state.items() if not k.startswith("relative_")}
               for key, state in ctl.rewards.state_dict().items()}
        store.save_policy_states({"__costs__": old})
    with Store(url) as store:
        resumed = AutotuneController(engine, store, policy="ucb", arms=arms)
        costs = resumed.rewards.costs["1"]
        assert costs.verify == ctl.rewards.costs["1"].verify  # what requests measured, kept
        assert set(costs.relative_verify) == {"small", NO_MODEL}  # n-gram lookup runs no model


def test_a_calibration_in_the_background_serves_off_until_the_costs_are_known(engine, tmp_path, monkeypatch):
    """`calibrate_in_background` (a server's first start): the controller serves at once, OFF
    until the costs are measured, then stores them; closed while it calibrates, it stops and
    stores none."""
    import threading

    import autotune.control.controller as controller_module

    gate, measure = threading.Event(), controller_module.calibrate_costs
    monkeypatch.setattr(controller_module, "calibrate_costs", lambda *a: gate.wait(60) and measure(*a))
    arms = [OFF, Arm("small", 2), Arm("ngram", 3)]
    with Store(f"sqlite:///{tmp_path / 'store.db'}") as store:
        ctl = AutotuneController(engine, store, policy="ucb", arms=arms, calibrate_in_background=True)
        served = [ctl.generate(p, request_class="code", max_new_tokens=8).arm for p in PROMPTS[:3]]
        assert served == [OFF] * 3 and not ctl.calibrated.is_set()
        gate.set()
        assert ctl.calibrated.wait(120)
        ctl.close()
        assert {"1", "1 sampled"} <= set(store.load_policy_states("__costs__"))
        assert all(store.load_policy_states("__costs__")[key]["relative_verify"] for key in ("1", "1 sampled"))
    gate.clear()
    with Store(f"sqlite:///{tmp_path / 'stopped.db'}") as store:
        stopped = AutotuneController(engine, store, policy="ucb", arms=arms, calibrate_in_background=True)
        threading.Timer(0.2, gate.set).start()
        stopped.close()  # while it waits to calibrate
        assert not stopped.calibrated.is_set() and "1" not in store.load_policy_states("__costs__")


class ReplayRecorder(Policy):
    """Plays small:2 and records whether each update came with counterfactual estimates."""

    name = "replay-recorder"
    learns = True

    def __init__(self, arms):
        super().__init__(arms)
        self.replayed = []

    def choose(self, context):
        return Arm("small", 2)

    def update(self, context, arm, outcome):
        self.replayed.append(bool(outcome.siblings))  # one K per drafter: only a replay fills it


class Plays(Policy):
    """Plays one arm and keeps the estimates each update came with."""

    name = "plays"
    learns = True

    def __init__(self, arms, arm):
        super().__init__(arms)
        self.arm, self.told = arm, []

    def choose(self, context):
        return self.arm

    def update(self, context, arm, outcome):
        self.told.append(outcome.siblings)


def test_a_drafter_the_replay_cannot_run_still_prices_its_other_ks_while_the_others_are_replayed(target, draft_model):
    """The target drafting for itself behind a drafter that declares no replay (as feature heads
    and layer skip do): every draft is kept, so its acceptance per position prices its smaller
    K, beside the replayed arms; left out, each of its K had to be played to be known."""
    from engine import ModelDrafter
    from engine.drafters import Capabilities

    class Opaque(ModelDrafter):
        capabilities = Capabilities(batch=True)

    engine = SpeculativeEngine(target, {"small": draft_model, "opaque": Opaque(target)})
    arms = [OFF, Arm("small", 2), Arm("opaque", 1), Arm("opaque", 2), Arm("opaque", 4)]
    policy = Plays(arms, Arm("opaque", 4))
    ctl = AutotuneController(engine, policy=policy, min_baseline_steps=4)
    ctl.generate(PROMPTS[0], "code", max_new_tokens=24)
    told = policy.told[0]
    assert {"off", "small:2"} <= set(told)  # replayed
    assert {"opaque:1", "opaque:2"} <= set(told)  # from its acceptance per position


def test_feature_heads_are_replayed_when_asked_from_the_features_a_head_was_served_with(target, monkeypatch):
    """Only when asked (its cost outweighed what it taught on the many-classes bench); a request
    a feature head served handed it the target's features, and the replay reads those rather
    than running the target over the whole sequence."""
    from conftest import feature_head

    import engine.feature as feature

    forwards = []
    features_of = feature.target_features

    def counted(model, sequence, memo):
        forwards.append("features" not in memo)
        return features_of(model, sequence, memo)

    monkeypatch.setattr(feature, "target_features", counted)
    head = feature_head(target)
    engine = SpeculativeEngine(target, {"ngram": NGramDrafter(), "feature": head, "ngram+feature": HybridDrafter(head)})
    arms = [OFF, Arm("ngram", 2), Arm("feature", 2), Arm("ngram+feature", 3)]
    for played, asked, replayed, target_run in ((Arm("ngram", 2), False, False, False),
                                                (Arm("feature", 2), False, False, False),  # estimated below
                                                (Arm("ngram", 2), True, True, True),
                                                (Arm("feature", 2), True, True, False)):
        forwards.clear()
        policy = Plays(arms, played)
        ctl = AutotuneController(engine, policy=policy, min_baseline_steps=4, replay_features=asked)
        ctl.generate(PROMPTS[0], "code", max_new_tokens=24)
        told = policy.told[0]
        # a head's hybrid is estimated from the head's own rounds without a replay (`hybrid_estimates`)
        estimated = replayed or played.drafter == "feature"
        assert "off" in told and ("ngram+feature:3" in told) == estimated, (played, asked)
        assert any(forwards) == target_run, (played, asked)


class PlaysAndReplaysOff(Plays):
    """Finds nothing but OFF worth replaying, as a policy whose other classes priced every arm may."""

    def worth_replaying(self, context):
        return [OFF]


def test_with_heads_for_different_domains_a_keys_first_request_replays_every_heads_arm(target):
    """Which head fits a class is what the other classes' evidence cannot say (a prose head priced
    on code text); so with more than one head the heads are replayed, on a key's first request all
    of their arms whatever the policy finds worth it, and later as the policy asks."""
    from conftest import feature_head

    code, prose = feature_head(target, seed=0), feature_head(target, seed=1)
    one = SpeculativeEngine(target, {"ngram": NGramDrafter(), "feature": code})
    assert not AutotuneController(one, policy="ucb").others.replay_features
    two = SpeculativeEngine(target, {"ngram": NGramDrafter(), "feature": code, "feature-prose": prose,
                                     "ngram+feature-prose": HybridDrafter(prose)})
    arms = [OFF, Arm("ngram", 2), *(Arm(d, k) for d in ("feature", "feature-prose", "ngram+feature-prose")
                                    for k in (2, 4))]
    policy = PlaysAndReplaysOff(arms, Arm("feature", 2))
    ctl = AutotuneController(two, policy=policy, min_baseline_steps=4, counterfactual_budget=0.0)
    assert ctl.others.replay_features
    ctl.generate(PROMPTS[0], "prose", max_new_tokens=24)
    ctl.generate(PROMPTS[1], "prose", max_new_tokens=24)
    first, second = policy.told
    heads = {str(a) for a in arms if a.drafter != "ngram" and not a.is_off} - {"feature:2"}
    assert heads <= set(first) and not heads & set(second)
    assert "ngram:2" not in first  # the policy's choice still rules every other drafter


@pytest.mark.parametrize("budget, expected", [
    (0.0, [True, True, True, False, False, False, False]),  # none after learning: each is charged first
    (1e9, [True] * 7),  # a budget that never runs out
])
def test_counterfactuals_are_replayed_while_learning_then_within_a_time_budget(engine, budget, expected):
    policy = ReplayRecorder([OFF, Arm("small", 2), Arm("ngram", 3)])
    ctl = AutotuneController(engine, policy=policy, min_baseline_steps=4, counterfactual_requests=3,
                             counterfactual_budget=budget)
    for p in PROMPTS[:7]:
        ctl.generate(p, "code", max_new_tokens=8)
    # Requests 1 to 3 are learning (the costs were calibrated before the first, so it is replayed too);
    # after that a replay runs only while replays, itself included, fit in the budget.
    assert policy.replayed == expected


def test_concurrent_requests_from_threads_are_all_served_one_at_a_time_at_load_1(engine, tmp_path):
    with Store(f"sqlite:///{tmp_path / 't.db'}") as store:
        ctl = AutotuneController(engine, store, policy="thompson", arms=[OFF, Arm("small", 2)])
        results, errors = [], []
        start = threading.Barrier(8)

        def worker(i):
            start.wait()
            try:
                results.append(ctl.generate(PROMPTS[i % len(PROMPTS)], request_class="code", max_new_tokens=6))
            except Exception as exc:  # pragma: no cover - the assertion below reports it
                errors.append(exc)

        run_in_threads(worker, 8)
        ctl.close()
        assert not errors and len(results) == 8 and store.count() == 8
        # Requests waiting for the engine do not make a round dearer: served alone, each is keyed at load 1.
        assert {r.load for r in results} == {1} and [k for k in ctl.policy.state_dict() if "@" in k] == ["code@load1"]
        # ... but they waited, and that is recorded: the last served queued behind the seven others
        # (six here: the last thread may reach the engine's queue a moment after the first began).
        waited = sorted(r.queue_s for r in results)
        assert waited[-1] >= sum(sorted(r.metrics.total_s for r in results)[:6]) > waited[0]
        assert sorted(o["queue_s"] for o in store.observations()) == waited


@pytest.mark.parametrize("mix_classes", [True, False])
def test_concurrent_requests_are_coalesced_into_batches_and_a_bad_one_fails_alone(engine, target, tmp_path,
                                                                                 mix_classes):
    too_long = list(range(60)) * 5  # 300 tokens: more than the target's context of 256
    with Store(f"sqlite:///{tmp_path / 'm.db'}") as store:
        ctl = AutotuneController(engine, store, policy="ucb", arms=[OFF, Arm("small", 2), Arm("ngram", 3)],
                                 max_batch=8, batch_wait_ms=200, min_baseline_steps=4, mix_classes=mix_classes)
        start = threading.Barrier(8)
        results, errors = {}, {}
        free = hf_greedy(target, PROMPTS[4], 10)
        stopped = free[:free.index(free[2]) + 1]  # request 4 stops at its own stop token, its 3rd or before

        def worker(i):  # even: code, greedy (4 with a stop token); odd: chat, sampled but for one
            start.wait()
            options = {"temperature": 1.0, "seed": i} if i in (1, 3) else {}
            if i == 4:
                options = {"stop_token_ids": [free[2]]}
            if i == 2:
                options = {"logprobs": 0}
            try:
                results[i] = ctl.generate(too_long if i == 7 else PROMPTS[i], request_class="code" if i % 2 == 0
                                          else "chat", max_new_tokens=6 + i, **options)
            except Exception as exc:
                errors[i] = exc

        for _ in range(2):  # the second round's requests all arrive while the first are served
            run_in_threads(worker, 8)
            start.reset()
            assert sorted(results) == list(range(7)) and list(errors) == [7]
            assert results[4].request_class == "code"
            assert "exceeds the target's context" in str(errors[7])
            assert results[4].finish_reason == "stop" and results.pop(4).tokens == stopped
            assert [list(e) for e in results[2].logprobs] == [[t] for t in results[2].tokens]
            assert results[0].logprobs is None
            for i, r in results.items():  # each its own length and class, greedy ones the target's own output
                assert len(r.tokens) == 6 + i and r.request_class == ("code" if i % 2 == 0 else "chat")
                assert r.finish_reason == "length"
                if i not in (1, 3):
                    assert r.tokens == hf_greedy(target, PROMPTS[i], 6 + i)
            # served together and keyed on that load: batches of both classes, or one batch per class
            loads = [r.load for r in results.values()]
            assert max(loads) > 1 and (mix_classes or max(loads) <= 4)
        ctl.close()
        assert store.count() == 14
        observations = store.observations()
        assert {o["request_class"] for o in observations} == {"code", "chat"}  # each row its own class
        assert all(o["features"]["prompt_tokens"] == o["prompt_tokens"] for o in observations)  # and features
        assert any(key.startswith("(mixed)@load5+") for key in ctl.policy.state_dict()) == mix_classes
        with pytest.raises(ValueError, match="batches of several classes"):
            ctl.generate(PROMPTS[0], request_class="(mixed)")


class FirstRound:
    """A streamer that tells when its request's first output round has been decoded, and keeps
    what it was handed."""

    def __init__(self, event: threading.Event) -> None:
        self.event, self.puts, self.ends = event, [], 0

    def put(self, value) -> None:
        self.puts.append(value.reshape(-1).tolist())
        if len(self.puts) == 2:  # the prompt, then the first round
            self.event.set()

    def end(self) -> None:
        self.ends += 1


def three_then_the_rest(ctl: AutotuneController, worker, count: int) -> None:
    """Run `worker(i)` for i < count on threads: 0-2 arrive while the engine is busy, so they form
    one batch once it is free; the rest start then (their workers wait until it decodes)."""
    queue = ctl.coalescer
    with queue._cv:
        queue._busy = True
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(count)]
    for t in threads[:3]:
        t.start()
    while len(queue._queue) < 3:
        time.sleep(0.001)
    with queue._cv:
        queue._busy = False
        queue._start_worker()
    for t in threads[3:]:
        t.start()
    for t in threads:
        t.join()


def three_then_the_rest_while_failing(ctl: AutotuneController, worker, count: int, target, fail) -> None:
    """`three_then_the_rest` while `fail(module, args)`, a hook on the target's embedding, may
    raise (memory, a model error); then the controller is closed."""
    hook = target.model.embed_tokens.register_forward_pre_hook(fail)
    try:
        three_then_the_rest(ctl, worker, count)
    finally:
        hook.remove()
    ctl.close()


@pytest.mark.parametrize(("continuous", "prefill_chunk"), [(True, None), (False, None), (True, 4)])
def test_requests_arriving_during_a_batch_join_it_and_return_when_done(engine, target, tmp_path, continuous,
                                                                       prefill_chunk):
    """Continuous batching: short requests sent while a batch of long ones decodes join it
    (prefilled at once or 4 tokens a round) and return long before it ends, with their own
    output, and the policy learns every 32 rounds of the batch; with continuous=False they wait
    for it, and it is learned from once."""
    with Store(f"sqlite:///{tmp_path / 'j.db'}") as store:
        ctl = AutotuneController(engine, store, policy="ucb", arms=[OFF, Arm("small", 2)], max_batch=8,
                                 batch_wait_ms=200, continuous=continuous, min_baseline_steps=4,
                                 prefill_chunk=prefill_chunk)
        decoding = threading.Event()
        finished, results = {}, {}

        def worker(i):
            if i < 3:
                streamer = FirstRound(decoding) if i == 0 else None
                results[i] = ctl.generate(PROMPTS[i], "code", max_new_tokens=200, streamer=streamer)
            else:  # short ones, of another class, once that batch is decoding
                decoding.wait(10)
                results[i] = ctl.generate(PROMPTS[i], "chat", max_new_tokens=3 + i, temperature=(i % 2) * 1.0,
                                          seed=i)
            finished[i] = time.perf_counter()

        three_then_the_rest(ctl, worker, 6)
        ctl.close()
        for i, r in results.items():
            assert len(r.tokens) == (200 if i < 3 else 3 + i) and r.request_class == ("code" if i < 3 else "chat")
        assert [results[i].tokens for i in (0, 1, 2, 4)] == [
            hf_greedy(target, PROMPTS[i], 200 if i < 3 else 7) for i in (0, 1, 2, 4)]
        joined = max(finished[i] for i in (3, 4, 5)) < min(finished[i] for i in (0, 1, 2))
        assert joined == continuous
        assert store.count() == 6
        assert ctl.learner.updates == (200 // 32 + 1 if continuous else 2)  # a batch's 200 rounds: 7 segments


@pytest.mark.parametrize("prefill_chunk", [None, 8])  # 8 tokens: a chunk of up to 4 joiners is wider than a decode
def test_requests_whose_prefill_fails_are_taken_apart_and_only_those_that_fail_alone_fail(engine, target,
                                                                                         prefill_chunk):
    """A prefill of several requests that raises (memory, a model error), the batch's first or
    joiners' (also a chunked one, inside a round), is retried one request at a time: a request
    whose prefill fails alone too fails in its own caller, and the others are served in the
    batch (before, every caller of the batch, or of the joining group, got the error)."""
    ctl = AutotuneController(engine, policy="static", arms=[OFF], arm=OFF, max_batch=8, batch_wait_ms=200,
                             prefill_chunk=prefill_chunk)
    decoding = threading.Event()
    results, errors = {}, {}
    failing = [PROMPTS[1], PROMPTS[3]]

    def fail_prefills(module, args):
        ids = args[0].tolist()
        chunk = ids[0][:prefill_chunk or None]  # a prompt's first chunk (only first chunks are fed alone)
        if len(ids[0]) > 1 and (len(ids) > 1 or any(p[:len(chunk)] == chunk for p in failing)):
            raise RuntimeError("out of memory")

    def worker(i):
        try:
            if i < 3:
                streamer = FirstRound(decoding) if i == 0 else None
                results[i] = ctl.generate(PROMPTS[i], "code", max_new_tokens=60, streamer=streamer)
            else:
                decoding.wait(10)
                results[i] = ctl.generate(PROMPTS[i], "chat", max_new_tokens=5)
        except Exception as exc:
            errors[i] = exc

    three_then_the_rest_while_failing(ctl, worker, 5, target, fail_prefills)
    assert sorted(errors) == [1, 3] and all("out of memory" in str(e) for e in errors.values())
    assert sorted(results) == [0, 2, 4] and results[0].load > 1
    for i, r in results.items():
        assert r.tokens == hf_greedy(target, PROMPTS[i], 60 if i < 3 else 5)


@pytest.mark.parametrize(("continuous", "fails", "shows_output"),
                         [(False, "prefill", True), (False, "round", True), (True, "round", True),
                          (True, "round", False)])
def test_a_batch_that_fails_serves_its_requests_not_yet_streamed_alone(engine, target, continuous, fails,
                                                                        shows_output):
    """A static batch whose prefill raises, or a batch (static or continuous) whose decoding
    round raises: the requests whose streams have not begun are served one at a time, one that
    fails alone too getting its own error; a request whose stream had begun gets the batch's
    error rather than its output twice (before, every caller of the batch got the error). A
    streamer that shows nothing (the server's watch on a client awaiting the whole answer)
    never counts as begun."""
    ctl = AutotuneController(engine, policy="static", arms=[OFF], arm=OFF, max_batch=8, continuous=continuous)
    streamer = FirstRound(threading.Event())
    streamer.shows_output = shows_output
    results, errors = {}, {}

    def fail(module, args):
        rows, width = args[0].shape
        if rows > 1 and (width > 1) == (fails == "prefill") or width > 1 and args[0][0].tolist() == PROMPTS[2]:
            raise RuntimeError("out of memory")

    def worker(i):
        try:
            results[i] = ctl.generate(PROMPTS[i], "code", max_new_tokens=12, streamer=streamer if i == 0 else None)
        except Exception as exc:
            errors[i] = exc

    three_then_the_rest_while_failing(ctl, worker, 3, target, fail)
    streamed = fails == "round" and shows_output  # the prefill streamed request 0's prompt and first token
    assert sorted(errors) == ([0, 2] if streamed else [2]) and all("out of memory" in str(e) for e in errors.values())
    assert sorted(results) == ([1] if streamed else [0, 1])
    for i, r in results.items():
        assert r.tokens == hf_greedy(target, PROMPTS[i], 12) and r.load == 1
    assert streamer.ends == 1 and streamer.puts[0] == PROMPTS[0]  # streamed once, never twice
    if shows_output:
        assert sum(streamer.puts[1:], []) == (hf_greedy(target, PROMPTS[0], 12)[:1] if streamed else results[0].tokens)


@pytest.mark.parametrize("batches", [True, False])
def test_a_request_decoding_alone_pauses_for_one_that_arrives_and_both_finish_in_a_batch(
        engine, target, draft_model, tmp_path, batches):
    """Nothing joins the one-request path, so a request decoding alone pauses when another
    arrives and finishes in a continuous batch with it: its output, stream and record are the
    request's own, once, and the part served alone teaches the policy nothing (its drafter's
    prefill over part of an output would score model drafters low). An engine that cannot
    batch (a hybrid model's linear-attention layers) serves them one after the other instead."""
    if not batches:
        target = tiny_qwen3_next(0)
        engine = SpeculativeEngine(target, {"small": draft_model})
    with Store(f"sqlite:///{tmp_path / 'p.db'}") as store:
        ctl = AutotuneController(engine, store, policy="ucb", arms=[OFF, Arm("small", 2)], max_batch=4)
        learned = []
        update = ctl.policy.update
        ctl.policy.update = lambda context, arm, outcome: (learned.append(context.key), update(context, arm, outcome))
        decoding, results = threading.Event(), {}
        streamer = FirstRound(decoding)
        alone = threading.Thread(target=lambda: results.setdefault(0, ctl.generate(
            PROMPTS[0], "code", max_new_tokens=200, streamer=streamer)))
        alone.start()
        decoding.wait(10)
        results[1] = ctl.generate(PROMPTS[1], "chat", max_new_tokens=20, temperature=1.0, seed=3)
        alone.join()
        ctl.close()
        assert store.count() == 2
    first, second = results[0], results[1]
    assert first.tokens == hf_greedy(target, PROMPTS[0], 200)
    assert second.tokens == engine.generate(PROMPTS[1], second.arm, 20, SamplingParams(1.0, seed=3)).tokens
    assert streamer.puts[0] == PROMPTS[0] and sum(streamer.puts[1:], []) == first.tokens and streamer.ends == 1
    assert (first.metrics.prompt_tokens, first.metrics.new_tokens) == (len(PROMPTS[0]), 200)
    if batches:
        assert second.load == 2 and second.queue_s < first.metrics.total_s / 10  # it joined while the first decoded
        assert learned[0] == "(mixed)@load2-4"  # the batch's first segment, not the first request's part alone
    else:
        assert first.load == second.load == 1 and second.queue_s > first.metrics.total_s / 2  # it waited
        assert set(learned) == {"code@load1", "chat@load1"}


def test_a_request_its_arm_has_no_room_for_is_served_off(engine, target):
    """The target takes the request but the chosen arm's drafter has no room for its K drafts
    (a drafter's context may be shorter than the target's): OFF serves it, alone or in a batch,
    where it used to fail with the drafter's refusal."""
    near_limit = list(range(50)) * 5  # 250 + 4 new tokens fit the context; + K=3 drafts do not
    ctl = AutotuneController(engine, policy="static", arms=[OFF], arm="small:3", max_batch=4)
    alone = ctl.generate(near_limit, "code", 4)
    assert alone.arm == OFF and alone.tokens == hf_greedy(target, near_limit, 4)
    prompts = [PROMPTS[0], near_limit, PROMPTS[1]]
    outcomes = ctl._serve_coalesced(None, Batch.of([PendingRequest(p, "code", False, 4, SamplingParams(), None, 0.0)
                                                    for p in prompts]))
    assert [o.tokens for o in outcomes] == [hf_greedy(target, p, 4) for p in prompts]
    assert ctl.generate(PROMPTS[0], "code", 4).arm == Arm("small", 3)  # the others still speculate
    with pytest.raises(InvalidRequestError, match="exceeds the target's context"):
        ctl.generate(near_limit, "code", 8)  # 250 + 8 > 256: the target's own limit still refuses


def test_unlabelled_requests_are_classified_from_history(engine, tmp_path):
    with Store(f"sqlite:///{tmp_path / 'k.db'}") as store:
        ctl = AutotuneController(engine, store, policy="thompson", arms=[OFF, Arm("small", 2)])
        for i in range(10):
            ctl.generate([1, 2, 3] * 10, request_class="repetitive", max_new_tokens=4)
            ctl.generate(PROMPTS[i], request_class="plain", max_new_tokens=4, temperature=1.0, seed=i)
        ctl.close()
        ctl.classifier = RequestClassifier.from_store(store)
        assert ctl.generate([5, 6, 7] * 9, max_new_tokens=4).request_class == "repetitive"
        assert ctl.generate([9, 3, 44, 12, 8, 1], max_new_tokens=4, temperature=1.0, seed=1).request_class == "plain"
        ctl.close()
        assert store.observations(last=1)[0]["classified"]


class RogueArm(Policy):
    name = "rogue"

    def choose(self, context):
        return Arm("medusa", 4)


def test_policy_arms_the_engine_lacks_are_refused(engine):
    with pytest.raises(PolicyError, match="no drafter 'medusa'"):
        AutotuneController(engine, policy="ucb", arms=[Arm("medusa", 2)])
    ctl = AutotuneController(engine, policy=RogueArm([OFF]))
    with pytest.raises(PolicyError, match="chose arm medusa:4"):
        ctl.generate([1, 2, 3], request_class="x")
    with pytest.raises(PolicyError, match="unknown policy 'greedy'"):
        AutotuneController(engine, policy="greedy")


@pytest.mark.parametrize("setting, words", [
    ({"prefill_chunk": 0}, "prefill_chunk must be a positive number of tokens or None, not 0"),
    ({"max_batch": 2.5}, "max_batch must be an int >= 1, got 2.5"),  # was: the coalescer's thread died, callers hung
    ({"save_every": 0}, "save_every must be an int >= 1"),  # was: ZeroDivisionError at the first save
    ({"decide_every": 0}, "decide_every must be an int >= 1"),
    ({"batch_wait_ms": -5}, r"batch_wait_ms must be a number >= 0 \(finite\), got -5"),
    ({"counterfactual_budget": -0.5}, "counterfactual_budget must be a number >= 0"),
])
def test_a_controller_setting_out_of_range_is_refused_by_name(engine, setting, words):
    with pytest.raises(ValueError, match=words):
        AutotuneController(engine, max_batch=setting.pop("max_batch", 4), **setting)


def test_sampling_options_are_taken_by_name_and_an_unknown_one_is_refused(engine):
    ctl = AutotuneController(engine, policy="static", arms=[OFF], arm=OFF)
    with pytest.raises(InvalidRequestError, match=r"unknown sampling option\(s\) \['top_q'\]"):
        ctl.generate([1, 2, 3], "x", top_q=0.5)
    with pytest.raises(InvalidRequestError, match=r"\['best_of'\]; the others it takes: .*'top_k'"):
        ctl.generate_batch([[1, 2, 3]] * 2, "x", best_of=2)
    batching = AutotuneController(engine, policy="static", arms=[OFF], arm=OFF, max_batch=4)
    assert batching.generate([1, 2, 3], "x", max_new_tokens=4, allowed_token_ids=[5]).tokens == [5] * 4
    prompt_logprobs = batching.generate([1, 2, 3], "x", max_new_tokens=2, prompt_logprobs=0).prompt_logprobs
    assert prompt_logprobs[0] is None and [list(e) for e in prompt_logprobs[1:]] == [[2], [3]]

    def count_up(input_ids, scores):
        return scores.scatter(1, (input_ids[:, -1:] + 1) % 64, 1e4)

    assert batching.generate([1, 2, 3], "x", max_new_tokens=4, logits_processor=count_up).tokens == [4, 5, 6, 7]
    assert batching.generate([1, 2, 3], "x", max_new_tokens=4, logits_processor=count_up,
                             stopping_criteria=lambda input_ids, scores: input_ids[0, -1] == 6).tokens == [4, 5, 6]
    with pytest.raises(InvalidRequestError, match=r"out of vocabulary range \(size 64\): \[99\]"):
        batching.generate([1, 2, 3], "x", logit_bias={99: 1.0})  # refused in its caller, before any batch
    with pytest.raises(InvalidRequestError, match="bad_words need the engine's tokenizer"):
        batching.generate_batch([[1, 2, 3]] * 2, "x", bad_words=["def"])
    with pytest.raises(InvalidRequestError, match=r"request_class must be a string \(or None: classify it\), got \{\}"):
        batching.generate([1, 2, 3], {})  # was a TypeError from inside the coalescer (unhashable)


def test_the_reward_compares_a_request_with_off_on_the_same_request():
    from autotune.rewards.costs import CostModel
    from engine import GenerationMetrics

    costs = CostModel()
    # OFF: 10 ms prefill, 63 decode steps of 5 ms.
    normal = GenerationMetrics(new_tokens=64, rounds=63, prefill_s=0.01, verify_s=0.315, total_s=0.325,
                               verify_by_width={1: [0.315, 63]})
    assert RewardModel.request_reward(OFF, normal, 63, costs) == 1.0  # nothing to price it with yet
    costs.observe(OFF, normal)
    assert RewardModel.request_reward(OFF, normal, 63, costs) == pytest.approx(1.0)
    # An OFF request that stops after one token has no decode step: nothing to infer a step from.
    early_eos = GenerationMetrics(new_tokens=1, rounds=0, prefill_s=0.02, total_s=0.02)
    assert RewardModel.request_reward(OFF, early_eos, 0, costs) == pytest.approx(1.0)
    # A speculative request of 33 tokens in 0.1 s, 10 verifies of 3 tokens priced at a 1-token step
    # each (nothing says otherwise yet): OFF would have taken 0.01 + 32 x 5 ms.
    spec = GenerationMetrics(new_tokens=33, rounds=10, prefill_s=0.01, verify_s=0.054, total_s=0.1,
                             verify_by_width={3: [0.054, 10]})
    assert RewardModel.request_reward(Arm("small", 2), spec, 32, costs) == pytest.approx(0.17 / 0.1)
    # Its short output does not make it look slow, nor a long prompt's prefill.
    long_prompt = GenerationMetrics(new_tokens=33, rounds=10, prefill_s=0.2, verify_s=0.054, total_s=0.29,
                                    verify_by_width={3: [0.054, 10]})
    assert RewardModel.request_reward(Arm("small", 2), long_prompt, 32, costs) == pytest.approx(0.36 / 0.29)


def test_a_request_that_ran_while_the_machine_was_slow_scores_as_it_would_have_at_full_speed():
    from autotune.rewards.costs import CostModel
    from engine import GenerationMetrics

    costs = CostModel()
    off = GenerationMetrics(new_tokens=64, rounds=63, prefill_s=0.01, verify_s=0.315, total_s=0.325,
                            verify_by_width={1: [0.315, 63]})  # 5 ms steps
    costs.observe(OFF, off)

    def spec(speed: float) -> GenerationMetrics:  # 33 tokens in 10 rounds of a 6 ms verify, 2 ms drafting
        return GenerationMetrics(new_tokens=33, rounds=10, drafted=20, draft_steps=20, draft_rounds=10,
                                 prefill_s=0.013 / speed, draft_prefill_s=0.003 / speed,
                                 draft_s=0.02 / speed, verify_s=0.06 / speed, total_s=0.093 / speed,
                                 verify_by_width={3: [0.06 / speed, 10]})

    costs.observe(Arm("small", 2), spec(1.0))
    # OFF: the target's prefill (not the drafter's) + 32 steps of 5 ms, where the arm took 93 ms.
    assert RewardModel.request_reward(Arm("small", 2), spec(1.0), 32, costs) == pytest.approx(0.17 / 0.093)
    assert RewardModel.request_reward(Arm("small", 2), spec(0.5), 32, costs) == pytest.approx(0.17 / 0.093)


def test_no_reward_exceeds_the_tokens_its_rounds_committed_on_a_noisy_machine(engine, tmp_path):
    """A first OFF request that ran ten times slower (other work on the machine) made a 1-token
    step look dearer than any verify of several tokens, and every later speculative reward rose
    with it (61 of 126 after a demo on a busy machine, a K=1 arm that kept no draft at 2.39x
    OFF). No reward may exceed what the request's tokens per round allow, whatever the noise."""
    from autotune.bench.noise import InjectedDelays

    arms = [OFF, Arm("small", 1), Arm("small", 3), Arm("ngram", 3)]
    with Store(f"sqlite:///{tmp_path / 'noisy.db'}") as store:
        ctl = AutotuneController(engine, store, policy="ucb", arms=arms, min_baseline_steps=4, calibrate=False)
        with InjectedDelays([engine.target], burst_rate=1e6, burst_s=1e6, slowdown=10.0):  # all of it
            ctl.generate(PROMPTS[0], "code", max_new_tokens=16)
        with InjectedDelays([engine.target], seed=1, burst_rate=20.0, burst_s=0.01, slowdown=20.0):
            for i, prompt in enumerate(PROMPTS[1:] * 2):
                ctl.generate(prompt, "docs" if i % 2 else "code", max_new_tokens=16)
        ctl.close()
        rows = store.observations()
    assert {r["arm"] for r in rows} - {"off"}  # it did speculate
    for r in rows:
        own = r["rounds"] - r["probe_rounds"]  # the reward prices the arm's rounds, not OFF's among them
        assert r["reward"] <= max(1.0, (r["new_tokens"] - 1 - r["probe_rounds"]) / max(own, 1)) + 1e-9, r


def test_a_continuous_segment_scores_its_tokens_per_engine_second_against_off(engine):
    """Rows joining and leaving copy the caches, and a speculative batch does that more often
    (its rows finish at different rounds): a segment is priced on all its engine time but the
    target's prefills of joiners, which every arm pays, not on its drafts and verifies alone."""
    from engine import GenerationMetrics

    ctl = AutotuneController(engine, policy="thompson", arms=[OFF, Arm("small", 2)])
    rewards = []
    update = ctl.policy.update
    ctl.policy.update = lambda context, arm, outcome: (rewards.append(outcome.reward), update(context, arm, outcome))
    code = Context("code", 10, {})
    # OFF: 10 rows x 100 rounds of 10 ms verifies, 1.25 s in all with the copies and the controller's work.
    off = GenerationMetrics(rounds=100, verify_s=1.0, verify_by_width={1: [1.0, 100]}, total_s=1.25)
    ctl.learn_segment(OFF, code, off, 1000, 1000, fell_back=False)
    # small:2, the same 1000 tokens in 50 rounds: 11 ms verifies, 4 ms drafts, 0.4 s of copies and 0.1 s
    # of its drafter's prefills of joiners (1.25 s, as OFF took), and 0.5 s of the target's prefills of joiners.
    spec = GenerationMetrics(rounds=50, draft_s=0.2, draft_steps=100, draft_rounds=50, verify_s=0.55,
                             verify_by_width={3: [0.55, 50]}, prefill_s=0.6, draft_prefill_s=0.1, total_s=1.75)
    ctl.learn_segment(Arm("small", 2), code, spec, 1000, 500, fell_back=False)
    assert rewards == pytest.approx([1.0, 1.0])  # drafts, verifies and prefill alone: 1.18


def test_continuous_segments_are_learned_only_once_off_segments_priced_their_rounds(engine):
    """What an OFF round costs in a continuous batch (its copies as rows join and leave) is
    measured on OFF segments: a speculative segment before any taught nothing, and a learning
    policy plays OFF until one ran at that load or a load next to it."""
    from autotune.rewards.costs import CostModel
    from engine import GenerationMetrics

    ctl = AutotuneController(engine, policy="thompson", arms=[OFF, Arm("small", 2)], min_baseline_steps=0)
    rewards = []
    update = ctl.policy.update
    ctl.policy.update = lambda context, arm, outcome: (rewards.append(outcome.reward), update(context, arm, outcome))
    ctl.policy.choose = lambda context: Arm("small", 2)
    code = Context("code", 10, {})
    off = GenerationMetrics(rounds=100, verify_s=1.0, verify_by_width={1: [1.0, 100]}, total_s=1.25)
    spec = GenerationMetrics(rounds=50, draft_s=0.2, draft_steps=100, draft_rounds=50, verify_s=0.55,
                             verify_by_width={3: [0.55, 50]}, total_s=1.25)
    ctl.rewards.costs.setdefault("5+", CostModel()).observe(OFF, off)  # an OFF step is known at this load, from a batch
    ctl.learn_segment(Arm("small", 2), code, spec, 1000, 500, fell_back=False)
    assert rewards == [] and ctl.learner.updates == 0
    assert ctl.decide(Context("code", 10, {}), segments=True)[1] == OFF
    ctl.learn_segment(OFF, code, off, 1000, 1000, fell_back=False)
    ctl.learn_segment(Arm("small", 2), code, spec, 1000, 500, fell_back=False)
    assert rewards == pytest.approx([1.0, 1.0])
    assert [str(ctl.decide(Context("code", load, {}), segments=True)[1]) for load in (10, 3)] == ["small:2", "small:2"]


def test_off_is_measured_again_by_a_few_rounds_inside_a_request_not_by_serving_one_off(engine):
    """`remeasure_off_every` requests without an OFF step would send the next to OFF; the one
    before runs OFF rounds among its own instead, so the policy's arm serves every request."""
    ctl = AutotuneController(engine, policy=ReplayRecorder([OFF, Arm("small", 2)]), remeasure_off_every=3)
    results = [ctl.generate(PROMPTS[i % len(PROMPTS)], "code", max_new_tokens=16) for i in range(7)]
    assert [str(r.arm) for r in results] == ["small:2"] * 7
    assert [r.metrics.probe_rounds > 0 for r in results] == [False, False, True] * 2 + [False]


def test_a_drafters_first_requests_then_one_in_a_few_measure_off_among_their_rounds(engine, monkeypatch):
    """Each such request prices its drafter's verifies in OFF steps measured beside them, and is
    rewarded for the arm's own rounds: its OFF rounds neither count against the arm nor for it."""
    from autotune.rewards import reward as rewards

    default = AutotuneController(engine, policy=ReplayRecorder([OFF, Arm("small", 2)]))
    assert default.generate(PROMPTS[0], "code", max_new_tokens=16).metrics.probe_rounds == 0  # off by default
    monkeypatch.setattr(rewards, "PROBE_FIRST", 2)
    monkeypatch.setattr(rewards, "PROBE_EVERY", 3)
    ctl = AutotuneController(engine, policy=ReplayRecorder([OFF, Arm("small", 2)]))
    costs = ctl.rewards.costs_of(Context("code", 1, {}))
    calibrated = sum(len(obs) for obs in costs.relative_verify["small"].values())
    results = [ctl.generate(PROMPTS[i], "code", max_new_tokens=16) for i in range(7)]
    n = rewards.PROBE_ROUNDS
    assert [r.metrics.probe_rounds for r in results] == [n, n, 0, 0, n, 0, 0]
    assert costs.probed["small"] == [3, 2]
    assert sum(len(obs) for obs in costs.relative_verify["small"].values()) >= calibrated + 3
    assert costs.since_off == 2  # a probed request measured OFF's step: no OFF request is due
    for r in results:
        own = r.metrics.without_probes()
        assert r.reward <= max(1.0, (own.new_tokens - 1) / own.rounds) + 1e-9
    static = AutotuneController(engine, policy="static", arms=[OFF], arm="small:2")
    assert static.generate(PROMPTS[0], "code", max_new_tokens=16).metrics.probe_rounds == 0  # it learns nothing


def test_a_learning_policy_serves_off_until_its_load_has_enough_off_steps_in_any_class(engine):
    policy = ReplayRecorder([OFF, Arm("small", 2)])  # a learning policy that always asks for small:2
    ctl = AutotuneController(engine, policy=policy, min_baseline_steps=20, calibrate=False)
    arms = [str(ctl.generate(PROMPTS[i], request_class="code", max_new_tokens=8).arm) for i in range(4)]
    assert arms == ["off", "off", "off", "small:2"]  # 7 + 7 + 7 decode steps reach 20 only after the third
    # OFF's step is a property of the load, not of the class: a new class speculates at once
    assert str(ctl.generate(PROMPTS[4], request_class="docs", max_new_tokens=8).arm) == "small:2"
    # Calibrated before its first request (the default), a controller needs no OFF request at all
    calibrated = AutotuneController(engine, policy=ReplayRecorder([OFF, Arm("small", 2)]))
    assert str(calibrated.generate(PROMPTS[0], request_class="code", max_new_tokens=8).arm) == "small:2"
    static = AutotuneController(engine, policy="static", arms=[OFF], arm="small:2")
    assert str(static.generate(PROMPTS[0], request_class="code", max_new_tokens=8).arm) == "small:2"


def test_warm_up_covers_every_k_a_schedule_can_reach(engine, tmp_path):
    """The heuristic schedule grows K inside a request: a compiled engine must have those graphs first."""
    with Store(f"sqlite:///{tmp_path}/h.db") as store:
        heuristic = AutotuneController(engine, store, policy="heuristic", arms=[OFF, Arm("small", 3)],
                                       arm=Arm("small", 3))
        assert Arm("small", MAX_K) in heuristic._reachable_arms()
        static = AutotuneController(engine, store, policy="static", arms=[OFF, Arm("small", 3)], arm=Arm("small", 3))
        assert static._reachable_arms() == [OFF, Arm("small", 3)]


def test_a_label_the_store_could_not_keep_is_refused_and_learning_is_still_saved(engine, tmp_path):
    """A label the database cannot store (a lone surrogate, one past the key's length) would fail
    every later save of the policy on its key: it is refused by name, and what the other requests
    taught is saved."""
    url = f"sqlite:///{tmp_path / 'labels.db'}"
    with Store(url) as store:
        ctl = AutotuneController(engine, store, policy="ucb", arms=[OFF, Arm("small", 2)], save_every=1)
        for label in ("a\ud800", "c" * 121, ""):
            with pytest.raises(InvalidRequestError, match="request_class"):
                ctl.generate(PROMPTS[0], label, max_new_tokens=4)
        with pytest.raises(InvalidRequestError, match="prompts must be a list of prompts, got a single str"):
            ctl.generate_batch("abc", "code")
        ctl.generate(PROMPTS[0], "tenant ü " + "t" * 100, max_new_tokens=4)
        ctl.close()
        assert any(key.startswith("tenant ü") for key in store.load_policy_states("ucb"))
