"""Prompt prefixes kept across requests: a request that starts as an earlier one did prefills
only the rest, and decodes what it decodes alone."""

import pytest
import torch
from test_engine import hf_greedy

from engine import Arm, BatchRequest, HybridDrafter, NGramDrafter, SamplingParams, SpeculativeEngine
from engine.drafters import model_drafter_of
from engine.prefix import MIN_REUSE, PrefixCache


def kv(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One layer's keys and values for n positions, each position's number its value."""
    positions = torch.arange(n, dtype=torch.float32).view(1, 1, n, 1)
    return [(positions, -positions)]


def test_a_prefix_cache_gives_the_longest_shared_prefix_and_drops_the_least_recently_used():
    cache = PrefixCache(capacity=100)
    a = list(range(40))
    cache.insert(a, lambda: kv(40))
    n, got = cache.lookup(a[:30] + [99] * 5)
    assert n == 30 and got[0][0].flatten().tolist() == list(range(30))
    assert cache.lookup(a)[0] == 39  # the last token is always fed: its logits draw the first output
    assert cache.lookup(a[:MIN_REUSE - 1] + [99] * 30) == (0, None)  # too short a hit to pay

    cache.insert(a + [40, 41, 42], lambda: kv(43))  # extends the kept prompt: replaces it
    assert len(cache) == 1 and cache.tokens == 43 and cache.lookup(a + [40, 41, 42, 7])[0] == 43
    cache.insert(a[:20], lambda: pytest.fail("a kept prompt holds it already"))

    b, c = [100 + i for i in range(50)], [200 + i for i in range(30)]
    cache.insert(b, lambda: kv(50))
    assert cache.lookup(a + [5])[0] == 40  # the first prompt used last: b is now the oldest
    cache.insert(c, lambda: kv(30))  # 43 + 50 + 30 > 100 tokens
    assert cache.lookup(b + [5])[0] == 0 and cache.lookup(c + [5])[0] == 30 and cache.tokens == 73
    with pytest.raises(ValueError, match="at least"):
        PrefixCache(capacity=MIN_REUSE - 1)


def test_a_request_is_served_when_its_prompt_cannot_be_kept_for_want_of_memory(engine, target, monkeypatch):
    """Keeping only saves work: out of memory for the copy, the request is served and nothing is
    kept (what was kept stays)."""
    first, second = shared_start(2)
    engine.generate(first, "small:3", 4)

    def no_memory(self, length):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr("engine.runner.ModelRunner.cached", no_memory)
    monkeypatch.setattr("engine.batch.BatchCache.row", lambda self, b, length=None: no_memory(self, length))
    out = engine.generate(second, "small:3", 12)
    assert out.tokens == hf_greedy(target, second, 12) and out.metrics.cached_prompt_tokens == 40
    batch = engine.generate_batch([second + [1], second + [2]], "small:3", 6)
    assert [r.metrics.cached_prompt_tokens for r in batch] == [40, 40]  # the first prompt is still kept
    assert len(engine.runner.prefixes) == 1


@pytest.fixture
def engine(target, draft_model):
    """A fresh engine keeping prefixes (its caches start empty), with a model drafter and a
    hybrid of the same model, which share that model's kept prompts."""
    return SpeculativeEngine(target, {"small": draft_model, "ngram": NGramDrafter(max_ngram=3),
                                      "hybrid": HybridDrafter(draft_model)}, prefix_cache_tokens=1024)


def shared_start(n_prompts: int, start: int = 40, rest: int = 8, seed: int = 3) -> list[list[int]]:
    """Prompts of one `start` tokens long, each going on differently (its own first token)."""
    gen = torch.Generator().manual_seed(seed)
    head = torch.randint(0, 64, (start,), generator=gen).tolist()
    return [head + [i] + torch.randint(0, 64, (rest - 1,), generator=gen).tolist() for i in range(n_prompts)]


@pytest.mark.parametrize("arm", ["off", "small:3", "hybrid:3", "ngram:2"])
def test_a_request_reuses_an_earlier_prompts_start_and_decodes_as_the_target_alone(engine, target, arm):
    first, second = shared_start(2)
    engine.generate(first, arm, 12)
    out = engine.generate(second, arm, 12)
    assert out.metrics.cached_prompt_tokens == 40
    assert out.tokens == hf_greedy(target, second, 12)
    drafter = model_drafter_of(engine.drafters.get(Arm.parse(arm).drafter))
    if drafter is not None:  # the drafter's own cache too
        assert drafter.runner.reused == 40
    again = engine.generate(second, arm, 12)
    assert again.metrics.cached_prompt_tokens == len(second) - 1 and again.tokens == out.tokens
    scored = engine.generate(second, arm, 4, SamplingParams(prompt_logprobs=1))  # needs every position's logits
    assert scored.metrics.cached_prompt_tokens == 0 and scored.tokens == out.tokens[:4]


def test_a_sampled_request_draws_the_same_tokens_from_a_kept_prefix(target, draft_model):
    first, second = shared_start(2, seed=5)
    sampling = SamplingParams(temperature=1.0, seed=11)
    alone = SpeculativeEngine(target, {"small": draft_model}).generate(second, "small:3", 16, sampling)
    keeping = SpeculativeEngine(target, {"small": draft_model}, prefix_cache_tokens=1024)
    keeping.generate(first, "small:3", 4, sampling)
    reused = keeping.generate(second, "small:3", 16, sampling)
    assert reused.metrics.cached_prompt_tokens == 40 and reused.tokens == alone.tokens


@pytest.mark.parametrize("arm", ["off", "small:3", "hybrid:3"])
@pytest.mark.parametrize("prefill_chunk", [None, 5])
def test_batch_rows_reuse_kept_prefixes_and_decode_as_the_target_alone(engine, target, arm, prefill_chunk):
    """Rows starting as a prompt served before take its keys and values, next to rows fed from
    the start, at once and joining a row that decodes (chunked); the batch keeps its prompts."""
    served, *batch = shared_start(4)
    fresh = shared_start(1, seed=9)[0]
    engine.generate(served, arm, 4)
    out = engine.generate_batch([batch[0], fresh, batch[1]], arm, [10, 12, 14])
    assert [r.metrics.cached_prompt_tokens for r in out] == [40, 0, 40]
    assert out.metrics.cached_prompt_tokens == 80
    assert [r.tokens for r in out] == [hf_greedy(target, p, n) for p, n in zip([batch[0], fresh, batch[1]],
                                                                                [10, 12, 14])]
    session = engine.open_batch(arm, prefill_chunk=prefill_chunk)
    session.add([BatchRequest(fresh + [1, 2], 16)])  # starts as `fresh`, which the batch above kept
    session.step()
    session.add([BatchRequest(batch[2], 10), BatchRequest(fresh + [3], 10)])
    while session.live_rows or session.prefilling:
        session.step()
    joined = session.close()
    assert [r.metrics.cached_prompt_tokens for r in joined] == [len(fresh), 40, len(fresh)]
    assert [r.tokens for r in joined] == [hf_greedy(target, p, n) for p, n in
                                          zip([fresh + [1, 2], batch[2], fresh + [3]], [16, 10, 10])]


@pytest.mark.parametrize("arm", ["off", "small:3"])
def test_rows_starting_alike_have_their_shared_start_fed_once(engine, target, arm, monkeypatch):
    """Requests arriving together with one system prompt: nothing kept yet, the start they share
    is prefilled once and each row goes on from it (when that saves more than a forward costs)."""
    monkeypatch.setattr("engine.batch.FORWARD_COST_TOKENS", 16)  # 2 x 40 tokens saved are worth it here
    rows = [*shared_start(3, seed=4), shared_start(1, seed=6)[0]]
    out = engine.generate_batch(rows, arm, 12)
    assert [r.metrics.cached_prompt_tokens for r in out] == [40, 40, 40, 0]
    assert [r.tokens for r in out] == [hf_greedy(target, p, 12) for p in rows]
    monkeypatch.setattr("engine.batch.FORWARD_COST_TOKENS", 1000)  # not worth a forward: fed whole
    other = shared_start(3, seed=8)
    assert [r.metrics.cached_prompt_tokens for r in engine.generate_batch(other, arm, 4)] == [0, 0, 0]


def test_rows_starting_alike_beyond_a_kept_prompt_feed_the_rest_of_their_start_once(engine, target, monkeypatch):
    """Steady state behind one system prompt: it is kept, and requests arriving together about a
    new document share more than it. The document is fed once, after the kept system prompt."""
    monkeypatch.setattr("engine.batch.FORWARD_COST_TOKENS", 16)
    system, document = shared_start(1, start=20, rest=1, seed=2)[0][:20], shared_start(1, start=40, rest=1)[0][:40]
    engine.generate(system + [1, 2, 3], "off", 2)  # keeps the system prompt
    rows = [system + document + [i, 7, 7] for i in range(3)]
    out = engine.generate_batch(rows, "small:3", 12)
    assert [r.metrics.cached_prompt_tokens for r in out] == [60, 60, 60]
    assert [r.tokens for r in out] == [hf_greedy(target, p, 12) for p in rows]


@pytest.mark.parametrize("arm", ["off", "small:3", "hybrid:3"])
@pytest.mark.parametrize("batched", [False, True], ids=["alone", "in a batch"])
def test_a_chats_next_turn_reuses_the_last_turns_prompt_and_output(engine, target, draft_model, arm, batched):
    """A request keeps its prompt and output when done (target and drafter), so the next turn,
    which starts with both, prefills only its new message; the drafter drafts exactly as from a
    whole prefill (the same drafts kept as an engine keeping nothing)."""
    plain = SpeculativeEngine(target, {"small": draft_model, "hybrid": HybridDrafter(draft_model)})
    other = shared_start(1, seed=12)[0]

    def serve(e, prompt):
        return e.generate_batch([other, prompt], arm, 10)[1] if batched else e.generate(prompt, arm, 10)

    turn, kept = shared_start(1, start=20)[0], 0
    for _ in range(3):
        out, alone = serve(engine, turn), serve(plain, turn)
        assert out.metrics.cached_prompt_tokens == kept
        assert out.tokens == alone.tokens == hf_greedy(target, turn, 10)
        assert out.metrics.accepted == alone.metrics.accepted
        kept = len(turn) + len(out.tokens) - 1  # all but the last output token was fed
        turn = turn + out.tokens + [5, 6, 7]
        for prefixes in {id(r.prefixes): r.prefixes for r in (engine.runner, engine.drafters["small"].runner)}.values():
            n, kv = prefixes.lookup(turn)  # every kept prompt holds as many positions as it has tokens
            assert n == 0 or kv[0][0].shape[-2] == n
