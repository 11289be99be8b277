"""Batched decoding is lossless too: each request's output is the one it gets alone."""

import pytest
from test_engine import AlwaysWrongDrafter, hf_greedy, prompts

from engine import HybridDrafter, InvalidRequestError, NGramDrafter, SamplingParams, SpeculativeEngine


@pytest.fixture(scope="module")
def engine(target, draft_model):
    return SpeculativeEngine(target, {"small": draft_model, "self": target, "ngram": NGramDrafter(max_ngram=3),
                                      "wrong": AlwaysWrongDrafter(target), "hybrid": HybridDrafter(draft_model)})


def test_batched_greedy_equals_target_generate_for_every_arm(engine, target):
    batch = prompts(12)  # lengths 4..36: rows are padded differently
    limits = [9 + 3 * i for i in range(12)]  # rows finish at different rounds and leave the batch
    reference = [hf_greedy(target, p, n) for p, n in zip(batch, limits)]
    accepted = {}
    for arm in ("off", "small:1", "small:4", "self:8", "ngram:2", "ngram:6", "hybrid:4"):
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
    for arm in ("off", "small:3", "ngram:4", "hybrid:3"):
        alone = [engine.generate(p, arm, 20, s).tokens for p, s in zip(batch, params)]
        assert [r.tokens for r in engine.generate_batch(batch, arm, 20, params)] == alone, arm


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


def test_batch_bad_input(engine):
    with pytest.raises(InvalidRequestError, match="cannot run batched"):
        engine.generate_batch([[1, 2]], "wrong:2")
    with pytest.raises(InvalidRequestError, match="batch is empty"):
        engine.generate_batch([], "off")
    with pytest.raises(InvalidRequestError, match="prompt is empty"):
        engine.generate_batch([[1, 2], []], "off")
    with pytest.raises(InvalidRequestError, match="one entry per prompt"):
        engine.generate_batch([[1, 2]], "off", [5, 6])
