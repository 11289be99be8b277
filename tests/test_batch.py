"""Batched decoding is lossless too: each request's output is the one it gets alone."""

import pytest
import torch
from conftest import feature_head
from test_engine import AlwaysWrongDrafter, hf_greedy, prompts

from engine import (
    Arm,
    BatchRequest,
    HybridDrafter,
    InvalidRequestError,
    NGramDrafter,
    RoundControl,
    SamplingParams,
    SpeculativeEngine,
)


@pytest.fixture(scope="module")
def engine(target, draft_model):
    head = feature_head(target)
    return SpeculativeEngine(target, {"small": draft_model, "self": target, "ngram": NGramDrafter(max_ngram=3),
                                      "wrong": AlwaysWrongDrafter(target), "hybrid": HybridDrafter(draft_model),
                                      "feature": head, "ngram+feature": HybridDrafter(head)})


@pytest.fixture(params=["grouped", "a forward per length", "compacted every round"])
def cache_layout(request, monkeypatch):
    """Rows prefilled as the engine groups them, or each distinct length in a forward of its own
    (the most groups: every join and drafter prefill appends and reorders cache rows), or with
    both caches dropping their holes before every round (BatchCache.compact)."""
    if request.param == "a forward per length":
        monkeypatch.setattr("engine.batch.FORWARD_COST_TOKENS", 0)
    elif request.param == "compacted every round":
        monkeypatch.setattr("engine.batch.COMPACT_SLACK", -(1 << 30))


@pytest.fixture(params=[None, 5], ids=["prefilled at once", "chunked prefill"])
def prefill_chunk(request):
    """A batch's `prefill_chunk`: requests joining while rows decode are prefilled in one go, or
    5 tokens a round (rows x columns; one column at least)."""
    return request.param


def test_batched_greedy_equals_target_generate_for_every_arm(engine, target, cache_layout):
    batch = prompts(12)  # lengths 4..36: rows are padded differently
    limits = [9 + 3 * i for i in range(12)]  # rows finish at different rounds and leave the batch
    reference = [hf_greedy(target, p, n) for p, n in zip(batch, limits)]
    accepted = {}
    for arm in ("off", "small:1", "small:4", "self:8", "ngram:2", "ngram:6", "hybrid:4", "feature:3",
                "ngram+feature:4"):
        out = engine.generate_batch(batch, arm, limits)
        assert [r.tokens for r in out] == reference, arm
        accepted[arm] = sum(r.metrics.accepted for r in out)
        assert out.metrics.new_tokens == sum(limits)
        if arm == "self:8":  # the target as its own drafter: every draft kept
            assert all(r.metrics.acceptance == 1.0 for r in out)
    assert accepted["small:4"] > 0 and accepted["ngram:6"] > 0 and accepted["hybrid:4"] > 0
    assert engine.generate_batch(batch, "self:8", limits).metrics.rounds < engine.generate_batch(
        batch, "off", limits).metrics.rounds


def test_eos_inside_a_batched_draft_stops_that_row_only(target):
    batch = prompts(4, seed=3)
    eos = hf_greedy(target, batch[0], 30)[6]  # the first row emits this token 7th
    target.generation_config.eos_token_id = eos
    try:
        engine = SpeculativeEngine(target, {"self": target})
        reference = [hf_greedy(target, p, 30, eos=eos) for p in batch]
        assert len(reference[0]) <= 7
        for arm in ("off", "self:8"):
            assert [r.tokens for r in engine.generate_batch(batch, arm, 30)] == reference, arm
    finally:
        target.generation_config.eos_token_id = None


def test_batched_sampling_draws_what_each_request_draws_alone(engine):
    """Each row has its own generator, drawn in the single-request order, and its own sampling
    (a batch of several classes mixes greedy rows and temperatures); the single-request
    sampler's distribution is tested in test_sampling.py."""
    batch = prompts(8, seed=5)
    params = [SamplingParams(temperature=(1.0, 0.0, 0.7)[i % 3], top_p=0.9 if i % 2 else 1.0, seed=i)
              for i in range(8)]
    for arm in ("off", "small:3", "ngram:4", "hybrid:3", "feature:2", "ngram+feature:3"):
        alone = [engine.generate(p, arm, 20, s).tokens for p, s in zip(batch, params)]
        assert [r.tokens for r in engine.generate_batch(batch, arm, 20, params)] == alone, arm


def test_rows_with_one_prompt_prefill_it_once_and_each_draws_what_it_draws_alone(engine, monkeypatch):
    """A request's n choices: the target and a model drafter feed each distinct prompt once and
    copy its cache rows; every row then decodes as it does alone (greedy, sampled from its own
    seed, its prompt's logprobs)."""
    from engine.batch import BatchCache

    fed, forward = [], BatchCache.forward

    def counting(self, ids, *args, **kwargs):
        if self.slots == 0:  # a prefill
            fed.append(ids.shape[0])
        return forward(self, ids, *args, **kwargs)

    monkeypatch.setattr(BatchCache, "forward", counting)
    p, q = prompts(2, seed=41)
    batch = [p, p, q, p, q]
    params = [SamplingParams(1.0, seed=0, prompt_logprobs=1), SamplingParams(1.0, seed=1, prompt_logprobs=1),
              SamplingParams(), SamplingParams(prompt_logprobs=1, logprobs=1), SamplingParams(0.7, top_p=0.9, seed=4)]
    for arm, prefills in (("off", [2]), ("small:3", [2, 2]), ("hybrid:3", [2, 2])):
        fed.clear()
        out = engine.generate_batch(batch, arm, 16, params)
        assert fed == prefills, arm
        alone = [engine.generate(x, arm, 16, s) for x, s in zip(batch, params)]
        assert [r.tokens for r in out] == [r.tokens for r in alone], arm
        assert out.results[0].tokens != out.results[1].tokens  # one prompt, two seeds
        got, want = out.results[3].prompt_logprobs, alone[3].prompt_logprobs
        assert out.results[0].prompt_logprobs == got
        assert got[0] is None and [sorted(e) for e in got[1:]] == [sorted(e) for e in want[1:]]
        assert [v for e in got[1:] for v in e.values()] == pytest.approx([v for e in want[1:] for v in e.values()],
                                                                         abs=1e-5)


def test_length_groups_are_the_cheapest_split_of_the_sorted_lengths():
    """Against every split of the sorted lengths into runs (a forward costs FORWARD_COST_TOKENS
    plus rows x its longest)."""
    import itertools
    import random

    from engine.batch import FORWARD_COST_TOKENS, length_groups

    def cost(groups, lengths):
        return sum(FORWARD_COST_TOKENS + len(g) * max(lengths[i] for i in g) for g in groups)

    rng = random.Random(0)
    for _ in range(200):
        lengths = [rng.choice([rng.randint(1, 40), rng.randint(100, 900)]) for _ in range(rng.randint(1, 7))]
        groups = length_groups(lengths)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        order = sorted(range(len(lengths)), key=lambda i: lengths[i])
        best = min(cost([order[a:b] for a, b in zip((0, *cuts), (*cuts, len(order)))], lengths)
                   for r in range(len(order)) for cuts in itertools.combinations(range(1, len(order)), r))
        assert cost(groups, lengths) == best
    assert length_groups([5, 300, 6, 280]) == [[0, 2], [3, 1]] and length_groups([20, 30, 40]) == [[0, 1, 2]]


def test_rows_of_very_different_lengths_prefill_in_groups_and_decode_as_alone(engine, monkeypatch):
    """Short prompts are not padded to a long one's length: two forwards (target and drafter
    each), and every row, shared, scored, greedy or sampled, gets what it gets alone."""
    from engine.batch import BatchCache

    fed, forward = [], BatchCache.forward

    def counting(self, ids, *args, **kwargs):
        if self.slots == 0:
            fed.append(tuple(ids.shape))
        return forward(self, ids, *args, **kwargs)

    monkeypatch.setattr(BatchCache, "forward", counting)
    short = prompts(3, seed=61)
    long = [sum(prompts(8, seed=62 + i), []) for i in range(2)]  # about 150 tokens each
    batch = [short[0], long[0], short[1], long[1], short[2], long[0]]
    params = [SamplingParams(), SamplingParams(prompt_logprobs=1), SamplingParams(1.0, seed=2), SamplingParams(),
              SamplingParams(0.7, seed=4), SamplingParams(prompt_logprobs=1)]
    for arm in ("off", "hybrid:3"):
        fed.clear()
        out = engine.generate_batch(batch, arm, 12, params)
        assert [rows for rows, _ in fed] == [3, 2] * (1 if arm == "off" else 2), fed  # short ones, then long ones
        for r, p, s in zip(out.results, batch, params):
            alone = engine.generate(p, arm, 12, s)
            assert r.tokens == alone.tokens, arm
            if s.prompt_logprobs is not None:
                assert [sorted(e) for e in r.prompt_logprobs[1:]] == [sorted(e) for e in alone.prompt_logprobs[1:]]


def test_scored_prompts_are_prefilled_in_chunks_within_the_logits_budget(engine, monkeypatch):
    """Prompt logprobs of a batch (an evaluation harness's log-likelihoods) come from chunks of
    positions whose logits stay within the budget, and are those each prompt gets alone."""
    import engine.batch as batch_module

    budget = 4 * 3 * engine.vocab_size  # 4 rows fed: chunks of 3 positions
    monkeypatch.setattr(batch_module, "PROMPT_LOGITS_BUDGET", budget)
    held, forward = [], batch_module.BatchCache.forward

    def measuring(self, ids, *args, **kwargs):
        logits = forward(self, ids, *args, **kwargs)
        held.append(logits.numel())
        return logits

    monkeypatch.setattr(batch_module.BatchCache, "forward", measuring)
    batch = prompts(4, seed=51)  # different lengths: rows start in different chunks
    params = [SamplingParams(prompt_logprobs=2), SamplingParams(prompt_logprobs=0), SamplingParams(),
              SamplingParams(1.0, seed=3, prompt_logprobs=1)]
    out = engine.generate_batch(batch, "small:3", 8, params)
    prefill = held[:max(map(len, batch)) // 3 + 1]
    assert len(prefill) > 3 and max(prefill) <= budget
    for r, p, s in zip(out.results, batch, params):
        alone = engine.generate(p, "small:3", 8, s)
        assert r.tokens == alone.tokens
        if s.prompt_logprobs is None:
            assert r.prompt_logprobs is None
            continue
        assert r.prompt_logprobs[0] is None and len(r.prompt_logprobs) == len(p)
        assert [sorted(e) for e in r.prompt_logprobs[1:]] == [sorted(e) for e in alone.prompt_logprobs[1:]]
        assert [v for e in r.prompt_logprobs[1:] for v in e.values()] == pytest.approx(
            [v for e in alone.prompt_logprobs[1:] for v in e.values()], abs=1e-5)


@pytest.mark.parametrize("arm", ["off", "small:3", "ngram:4", "hybrid:3", "ngram+feature:3"])
def test_requests_joining_a_running_batch_get_what_they_get_alone(engine, arm, cache_layout, prefill_chunk):
    """Continuous batching: requests join between rounds (two at the 2nd round, one at the 5th,
    two more once every row before them is done) and decode as they do alone, greedy and
    sampled, prefilled at once or a chunk a round; each result is handed over the moment its
    row is done."""
    first, joiners = prompts(3, seed=11), prompts(5, seed=12)
    first_limits, joiner_limits = [4, 12, 30], [8, 20, 3, 15, 6]
    first_params = [SamplingParams(seed=0), SamplingParams(1.0, seed=1), SamplingParams(seed=2)]
    joiner_params = [SamplingParams(temperature=1.0 if i % 2 else 0.0, top_p=0.9, seed=10 + i) for i in range(5)]
    waiting = [BatchRequest(p, n, s) for p, n, s in zip(joiners, joiner_limits, joiner_params)]
    calls, live_at_join, done = [0], [], []

    def admit(live_rows: int) -> list[BatchRequest]:
        calls[0] += 1
        take = min(2 if calls[0] == 2 else 1 if calls[0] == 5 else 2 if live_rows == 0 else 0, len(waiting))
        live_at_join.extend([live_rows] * take)
        return [waiting.pop(0) for _ in range(take)]

    out = engine.generate_batch(first, arm, first_limits, first_params, admit=admit,
                                on_done=lambda i, result: done.append((i, list(result.tokens))),
                                prefill_chunk=prefill_chunk)
    alone = [engine.generate(p, arm, n, s).tokens for p, n, s in
             zip(first + joiners, first_limits + joiner_limits, first_params + joiner_params)]
    assert [r.tokens for r in out] == alone
    assert live_at_join[:2] == [3, 3] and live_at_join[3:] == [0, 0]  # the last two: an emptied batch
    assert sorted(i for i, _ in done) == list(range(8)) and all(tokens == alone[i] for i, tokens in done)
    assert [i for i, _ in done].index(0) < [i for i, _ in done].index(2)  # row 0 handed over first
    assert all(0 < r.metrics.total_s <= out.metrics.total_s for r in out)
    assert out.metrics.new_tokens == sum(map(len, alone))
    assert out.metrics.prompt_tokens == sum(r.metrics.prompt_tokens for r in out)


class Recorder:
    """A streamer that keeps what it was handed."""

    def __init__(self) -> None:
        self.puts, self.ends = [], 0

    def put(self, value) -> None:
        self.puts.append(value.reshape(-1).tolist())

    def end(self) -> None:
        self.ends += 1


@pytest.mark.parametrize("arm", ["off", "small:3", "ngram:4", "hybrid:3", "feature:3"])
def test_a_paused_request_finishes_in_a_batch_as_it_would_alone(engine, arm, cache_layout, monkeypatch):
    """`generate(control=RoundControl(pause=...))` stops a request between rounds; its `rest`, added to a batch beside
    another request, finishes it: the output (greedy, and sampled draw for draw from its seed:
    its random stream goes on), the stream (the prompt once, every token once, ended once) and
    the counts over both parts and its logprobs and prompt logprobs are the request's own; the
    batch's metrics count its own work. The target's cache of the paused part joins the batch's,
    so the target prefills the other request only."""
    from engine.batch import BatchCache

    fed, forward = [], BatchCache.forward

    def counting(self, ids, *args, **kwargs):
        if self.slots == 0 and self.model is engine.target:
            fed.append(ids.shape[0])
        return forward(self, ids, *args, **kwargs)

    monkeypatch.setattr(BatchCache, "forward", counting)
    prompt, other = prompts(2, seed=31)
    for sampling in (SamplingParams(logprobs=1, prompt_logprobs=1), SamplingParams(1.0, top_p=0.9, seed=7, logprobs=1)):
        alone = engine.generate(prompt, arm, 24, sampling)
        asked, streamer = [0], Recorder()

        def pause(asked=asked) -> bool:
            asked[0] += 1
            return asked[0] > 3

        head = engine.generate(prompt, arm, 24, sampling, streamer=streamer, control=RoundControl(pause=pause))
        assert head.rest is not None and 3 <= len(head.tokens) < 24 and streamer.ends == 0
        assert head.finish_reason is None  # not finished: paused
        assert head.tokens == alone.tokens[:len(head.tokens)]
        session = engine.open_batch(arm)
        assert head.rest.cached is not None and head.rest.cached[0][0].shape[-2] == len(prompt) + len(head.tokens) - 1
        fed.clear()
        session.add([BatchRequest(other, 10, SamplingParams(seed=1, prompt_logprobs=0)), head.rest])
        assert fed == [1]
        while session.live_rows:
            session.step()
        out = session.close()
        assert out[1].tokens == alone.tokens, (arm, sampling)
        assert out[1].finish_reason == alone.finish_reason == "length"
        assert out[1].prompt_logprobs == alone.prompt_logprobs  # from its own prefill, before the pause
        own = engine.generate(other, "off", 1, SamplingParams(prompt_logprobs=0)).prompt_logprobs[1:]
        assert [list(e) for e in out[0].prompt_logprobs[1:]] == [list(e) for e in own]  # beside a resumed row
        assert torch.allclose(torch.tensor([v for e in out[0].prompt_logprobs[1:] for v in e.values()]),
                              torch.tensor([v for e in own for v in e.values()]), atol=1e-4)
        assert [list(e) for e in out[1].logprobs] == [list(e) for e in alone.logprobs]
        assert torch.allclose(torch.tensor([v for e in out[1].logprobs for v in e.values()]),
                              torch.tensor([v for e in alone.logprobs for v in e.values()]), atol=1e-4)
        assert streamer.puts[0] == prompt and sum(streamer.puts[1:], []) == alone.tokens and streamer.ends == 1
        m = out[1].metrics
        assert (m.prompt_tokens, m.new_tokens) == (len(prompt), 24)
        assert m.rounds > head.metrics.rounds and m.total_s > head.metrics.total_s
        assert m.drafted == head.metrics.drafted + out.metrics.drafted - out[0].metrics.drafted
        assert out.metrics.new_tokens == 10 + 24 - len(head.tokens)


def test_a_batch_session_switches_arms_between_rounds_and_stays_lossless(engine, target, cache_layout, prefill_chunk):
    """A server's batch: requests join mid-run and the arm changes every 3 rounds (model, feature
    head, n-gram, hybrid drafters, OFF; a model drafter or a head taken up again is prefilled over
    every live row; a chunked join spans switches and takes the drafter of the round it ends in)."""
    batch, limits = prompts(6, seed=21), [10 + 4 * i for i in range(6)]
    session = engine.open_batch("off", prefill_chunk)
    session.add([BatchRequest(p, n) for p, n in zip(batch[:4], limits[:4])])
    arms = ["small:3", "feature:2", "ngram:4", "ngram+feature:3", "hybrid:3", "self:2", "off", "small:2"]
    rounds, done = 0, []
    while session.live_rows or session.prefilling:
        if rounds == 4:
            session.add([BatchRequest(p, n) for p, n in zip(batch[4:], limits[4:])])
        if rounds % 3 == 2:
            session.switch(Arm.parse(arms[rounds // 3 % len(arms)]))
        session.step()
        done += [i for i, _ in session.finished()]
        rounds += 1
    out = session.close()
    assert [r.tokens for r in out] == [hf_greedy(target, p, n) for p, n in zip(batch, limits)]
    assert sorted(done) == list(range(6)) and sum(r.metrics.accepted for r in out) > 0
    assert rounds == out.metrics.rounds
    assert session.committed == sum(len(r.tokens) - 1 for r in out)  # all but each prefill's token
    assert session.row_rounds < session.committed  # drafts kept: OFF commits one token per row and round

    near_limit = list(range(50)) * 5  # 250 + 4 new tokens fit the context; + K=3 drafts do not
    session = engine.open_batch("off")
    session.add([BatchRequest(near_limit, 4)])
    with pytest.raises(InvalidRequestError, match="drafter 'small''s context"):
        session.switch(Arm("small", 3))
    while session.live_rows:
        session.step()
    assert session.arm == Arm() and session.close()[0].tokens == hf_greedy(target, near_limit, 4)


@pytest.mark.parametrize("arm", ["off", "small:3", "hybrid:3"])
def test_a_long_prompt_joins_a_chunk_per_round_while_the_rows_decode(engine, arm, monkeypatch):
    """Chunked prefill: a 70-token prompt added to two decoding rows with prefill_chunk=16 is fed
    16 tokens a round (5 rounds) while both rows commit tokens every round, and joins in the
    round of its last chunk; a 3-token prompt added behind it waits for a round with budget left
    (the last, 6 + 3 tokens). Each gets what it gets alone: sampled draws, logprobs and prompt
    logprobs."""
    from engine.batch import BatchCache

    fed, forward = [], BatchCache.forward

    def counting(self, ids, *args, **kwargs):
        if self.model is engine.target and self is not session._run.target_cache:
            fed.append(ids.numel())
        return forward(self, ids, *args, **kwargs)

    decoding = [BatchRequest(p, 40, SamplingParams(seed=i)) for i, p in enumerate(prompts(2, seed=41))]
    long = sum(prompts(9, seed=42), [])[:70]
    joining = BatchRequest(long, 20, SamplingParams(1.0, top_p=0.9, seed=5, logprobs=2, prompt_logprobs=1))
    session = engine.open_batch(arm, prefill_chunk=16)
    session.add(decoding)
    monkeypatch.setattr(BatchCache, "forward", counting)
    session.add([joining])
    assert fed == [] and (session.live_rows, session.prefilling) == (2, 1)
    short = BatchRequest(prompts(1, seed=43)[0][:3], 12, SamplingParams(seed=3))
    committed = []
    while session.prefilling:
        if len(committed) == 3:
            session.add([short])
        before = session.committed
        session.step()
        committed.append(session.committed - before)
    assert fed == [16, 16, 16, 16, 6, 3] and session.live_rows == 4
    assert len(committed) == 5 and min(committed) >= 2  # the decoding rows went on every round
    while session.live_rows:
        session.step()
    out = session.close()
    for result, request in zip(out, [*decoding, joining, short], strict=True):
        alone = engine.generate(request.prompt, arm, request.max_new_tokens, request.sampling)
        assert result.tokens == alone.tokens
    alone = engine.generate(long, arm, 20, joining.sampling)
    assert [list(e) for e in out[2].logprobs] == [list(e) for e in alone.logprobs]
    assert [list(e) for e in out[2].prompt_logprobs[1:]] == [list(e) for e in alone.prompt_logprobs[1:]]
    assert torch.allclose(torch.tensor([v for e in out[2].prompt_logprobs[1:] for v in e.values()]),
                          torch.tensor([v for e in alone.prompt_logprobs[1:] for v in e.values()]), atol=1e-4)
    assert out[2].metrics.prefill_s > 0 and out.metrics.prefill_s > out[2].metrics.prefill_s


def test_a_chunked_join_that_fails_is_retried_alone_and_the_batch_goes_on(engine, target, monkeypatch):
    """A chunked join of two requests whose prefill raises (memory, a model error) is tried again
    a request at a time: the one that fails alone comes back from `failed`, the other joins, and
    the row decoding all along is untouched; `generate_batch` raises a joiner's failure."""
    from engine.batch import BatchCache

    mark = 63  # a token only the failing prompt has, the longest: the mark is in its join's first chunk
    first, good, bad = prompts(3, seed=61)
    first, good, bad = [t % 60 for t in first], [t % 60 for t in good], [mark, *bad]
    forward = BatchCache.forward

    def failing(self, ids, *args, **kwargs):
        if self.slots == 0 and self.model is target and (ids == mark).any():
            raise RuntimeError("out of memory")
        return forward(self, ids, *args, **kwargs)

    monkeypatch.setattr(BatchCache, "forward", failing)
    session = engine.open_batch("small:2", prefill_chunk=4)
    session.add([BatchRequest(first, 30)])
    assert session.add([BatchRequest(bad, 10), BatchRequest(good, 10)]) == [1, 2]
    failed = []
    while session.live_rows or session.prefilling:
        session.step()
        failed += session.failed()
    assert [(i, str(exc)) for i, exc in failed] == [(1, "out of memory")]
    out = session.close()
    assert [r.tokens for r in out] == [hf_greedy(target, first, 30), hf_greedy(target, good, 10)]
    with pytest.raises(RuntimeError, match="out of memory"):
        engine.generate_batch([first], "off", 30, admit=lambda live: [BatchRequest(bad, 5)] if live else [],
                              prefill_chunk=4)


@pytest.mark.parametrize("arm", ["off", "small:3", "hybrid:3"])
def test_a_batch_that_runs_for_long_drops_its_holes_and_stays_lossless(engine, arm, monkeypatch):
    """A session kept going as a busy server keeps it (a request joins whenever one finishes,
    200 requests): its caches' slots stay within COMPACT_RATIO x the longest row (plus COMPACT_SLACK),
    where they used to grow with every round, and each request gets what it gets alone."""
    from engine.batch import COMPACT_RATIO

    monkeypatch.setattr("engine.batch.COMPACT_SLACK", 8)
    pool = [BatchRequest(p, 6 + 5 * i % 23, SamplingParams(1.0 if i % 2 else 0.0, seed=i))
            for i, p in enumerate(prompts(24, seed=71))]
    session = engine.open_batch(arm)
    added = session.add(pool[:6])
    rounds, widest, longest = 0, 0, 0
    while session.live_rows:
        if done := session.finished():
            added += session.add([pool[(len(added) + j) % 24] for j in range(min(len(done), 200 - len(added)))])
        session.step()
        rounds += 1
        drafts = session._run.drafts  # a model's batched drafting, or a hybrid's around one
        caches = [session._run.target_cache] + ([getattr(drafts, "inner", drafts).cache] if arm != "off" else [])
        widest = max(widest, *(cache.slots for cache in caches))
        longest = max(longest, *(len(session._run.rows[i].tokens) for i in session.live), 0)
    out = session.close()
    assert len(out) == 200 and widest <= COMPACT_RATIO * longest + 8 + 4 < rounds  # uncompacted, slots >= rounds
    alone = [engine.generate(r.prompt, arm, r.max_new_tokens, r.sampling).tokens for r in pool]
    assert [r.tokens for r in out] == [alone[i % 24] for i in range(200)]


@pytest.mark.parametrize("arm", ["off", "hybrid:3"])
def test_a_session_that_keeps_no_results_holds_only_its_live_requests(engine, arm):
    """keep_results=False (a server's session, which may never drain): each request is dropped
    once `finished` hands it over, so the session holds only those still in it, and its results
    and the batch's totals are those of a session that keeps everything."""
    pool = [BatchRequest(p, 4 + 3 * i % 11, SamplingParams(1.0 if i % 2 else 0.0, seed=i))
            for i, p in enumerate(prompts(30, seed=81))]
    served, totals = {}, {}
    for keep in (True, False):
        session = engine.open_batch(arm, keep_results=keep)
        session.add(pool[:4])
        added, held, results = 4, 0, {}
        while session.live_rows:
            for i, result in session.finished():
                results[i] = result.tokens
                if added < len(pool):
                    session.add([pool[added]])
                    added += 1
            held = max(held, len(session._run.rows))
            session.step()
        results.update((i, result.tokens) for i, result in session.finished())
        out = session.close()
        served[keep], totals[keep] = results, out.metrics
        assert held == (len(session._run.rows) if keep else 4)  # kept: every request; else the 4 decoding
        assert len(out) == len(session._run.rows) == (len(pool) if keep else 0)
    assert served[True] == served[False] and len(served[False]) == len(pool)
    for field in ("new_tokens", "prompt_tokens", "drafted", "accepted", "drafted_per_position",
                  "accepted_per_position", "rounds"):
        assert getattr(totals[False], field) == getattr(totals[True], field), field


def test_a_failing_batched_drafter_falls_back_to_off(engine, target, draft_model, monkeypatch):
    calls = {"n": 0}
    forward = draft_model.forward

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("drafter blew up")
        return forward(*args, **kwargs)

    monkeypatch.setattr(draft_model, "forward", flaky)
    batch = prompts(5, seed=9)
    out = engine.generate_batch(batch, "small:3", 20)
    assert all(r.fell_back and "drafter blew up" in r.fallback_error for r in out)
    assert [r.tokens for r in out] == [hf_greedy(target, p, 20) for p in batch]


def test_a_batch_whose_target_fails_a_verify_step_falls_back_to_off(engine, target):
    """As alone (test_engine): the failed step had grown the first layer's cache only, so each
    layer is cut back by its own excess, and OFF finishes every row."""
    wide_steps = []

    def fail_the_second_verify(module, args, kwargs):
        if kwargs.get("hidden_states", args[0] if args else None).shape[1] > 1:
            wide_steps.append(1)
            if len(wide_steps) == 3:  # the prefill, a verify, then this one
                raise RuntimeError("no kernel for this shape")

    batch = prompts(5, seed=9)
    expected = [hf_greedy(target, p, 20) for p in batch]
    hook = target.model.layers[1].register_forward_pre_hook(fail_the_second_verify, with_kwargs=True)
    try:
        out = engine.generate_batch(batch, "small:3", 20)
    finally:
        hook.remove()
    assert all(r.fell_back and r.fallback_error == "verify: RuntimeError: no kernel for this shape" for r in out)
    assert [r.tokens for r in out] == expected
    assert out.metrics.drafted > 0


def test_batch_bad_input(engine):
    with pytest.raises(InvalidRequestError, match="cannot run batched"):
        engine.generate_batch([[1, 2]], "wrong:2")
    with pytest.raises(InvalidRequestError, match="batch is empty"):
        engine.generate_batch([], "off")
    with pytest.raises(InvalidRequestError, match="prompt is empty"):
        engine.generate_batch([[1, 2], []], "off")
    with pytest.raises(InvalidRequestError, match="one entry per prompt"):
        engine.generate_batch([[1, 2]], "off", [5, 6])


class RecordingLookup(NGramDrafter):
    """Prompt lookup that keeps every (context, draft) it proposed, to count drafts independently."""

    def __init__(self):
        super().__init__(max_ngram=3)
        self.proposals = []

    def propose(self, tokens, k, params, generator):
        draft, dist = super().propose(tokens, k, params, generator)
        if draft:
            self.proposals.append((tuple(tokens), draft))
        return draft, dist


def test_batched_counts_per_position_match_an_independent_count(target):
    """Each request's drafted and accepted counts per position, as the batch reports them, equal a
    count made from outside: every draft the lookup proposed for the request, kept as far as it
    matches the request's final output (greedy, so a draft is kept exactly where it matches)."""
    lookup = RecordingLookup()
    engine = SpeculativeEngine(target, {"ngram": lookup})
    batch = prompts(9, seed=23)
    out = engine.generate_batch(batch, "ngram:4", [12 + 3 * i for i in range(9)], SamplingParams(ignore_eos=True))
    assert sum(r.metrics.drafted for r in out) > 20 and sum(r.metrics.accepted for r in out) >= 5
    for prompt, result in zip(batch, out):
        final = prompt + result.tokens
        drafted, accepted = [0] * 4, [0] * 4
        for context, draft in lookup.proposals:
            if len(context) >= len(prompt) and final[:len(context)] == list(context):
                matched = next((j for j, t in enumerate(draft) if final[len(context) + j] != t), len(draft))
                for j in range(len(draft)):
                    drafted[j] += 1
                    accepted[j] += j < matched
        used = max((j + 1 for j, d in enumerate(drafted) if d), default=0)
        assert result.metrics.drafted_per_position == drafted[:used]
        assert result.metrics.accepted_per_position == accepted[:used]
