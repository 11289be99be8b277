"""How a batch prefills its rows, the engine's way against the way before, the same requests
both ways, taking turns.

`autotune bench choices`: a request's n sampled choices (vLLM's and OpenAI's `n`; best-of-n and
self-consistency sampling ask for them) with their prompt prefilled once and shared, against
every choice prefilling it. `autotune bench lengths`: rows of mixed lengths (a burst of every
class) prefilled in groups of similar length, against all in one forward padded to the longest.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable
from unittest import mock

import engine.batch as engine_batch
from autotune.bench.common import device_name, rotate
from autotune.classes import RequestClass
from engine import Arm, SamplingParams, SpeculativeEngine


def _every_choice():
    """Every row fed, also rows with the same prompt."""
    return mock.patch.object(engine_batch, "prefilled", functools.partial(engine_batch.prefilled, share=False))


def _one_forward():
    """Every row in one forward, padded to the longest."""
    return mock.patch.object(engine_batch, "length_groups", lambda lengths: [list(range(len(lengths)))])


class _Tally:
    """Per way of prefilling, the seconds, prefill seconds and tokens of the batches served."""

    def __init__(self, ways: dict[str, Callable]) -> None:
        self.ways = ways
        self.seconds, self.prefill, self.tokens = (dict.fromkeys(ways, 0.0), dict.fromkeys(ways, 0.0),
                                                   dict.fromkeys(ways, 0))

    def serve(self, engine: SpeculativeEngine, i: int, prompts: list[list[int]], arm: Arm, limits,
              sampling: list[SamplingParams]) -> bool:
        """One batch served each way, the i-th way first; whether the outputs were identical."""
        outputs = []
        for way in rotate(list(self.ways), i):
            with self.ways[way]():
                began = time.perf_counter()
                served = engine.generate_batch(prompts, arm, limits, sampling)
                self.seconds[way] += time.perf_counter() - began
            self.prefill[way] += served.metrics.prefill_s
            self.tokens[way] += served.metrics.new_tokens
            outputs.append([r.tokens for r in served])
        return all(o == outputs[0] for o in outputs)

    def summary(self, count: int, per: str) -> dict:
        """Tokens/s and prefill seconds per `per` (of `count`) each way, and the first way's
        tokens/s over the second's."""
        tps = {w: self.tokens[w] / self.seconds[w] for w in self.ways}
        first, second = self.ways
        return {"tokens_per_s": {w: round(v, 1) for w, v in tps.items()},
                f"prefill_s_per_{per}": {w: round(self.prefill[w] / count, 4) for w in self.ways},
                f"{first}_vs_{second}".replace(" ", "_"): round(tps[first] / tps[second], 3)}


def long_prompts(engine: SpeculativeEngine, cls: RequestClass, tokens: int, count: int) -> list[list[int]]:
    """`count` prompts of `tokens` tokens, each the class's prompts joined from a different one
    on (a few-shot prompt's shape)."""
    out = []
    for i in range(count):
        ids: list[int] = []
        j = i
        while len(ids) < tokens:
            ids += engine.encode(cls.prompts[j % len(cls.prompts)]).tolist()
            j += 1
        out.append(ids[-tokens:])
    return out


def bench_choices(engine: SpeculativeEngine, cls: RequestClass, arms: list[Arm], n: int, requests: int,
                  long_tokens: int) -> dict:
    """Each case (the class's prompts, or `long_tokens`-token ones; an arm) serves `requests`
    requests of `n` choices, seeded 0..n-1, as one batch each, with the prompt shared and fed
    for every choice; the outputs must be identical."""
    prompt_sets = {"workload": [engine.encode(p).tolist() for p in cls.prompts[:requests]],
                   f"{long_tokens} tokens": long_prompts(engine, cls, long_tokens, requests)}
    sampling = [SamplingParams(cls.temperature, cls.top_p, seed=j) for j in range(n)]
    out, identical = {}, True
    for kind, prompts in prompt_sets.items():
        for arm in arms:
            tally = _Tally({"shared": contextlib.nullcontext, "every choice": _every_choice})
            for i, prompt in enumerate(prompts):
                identical &= tally.serve(engine, i, [prompt] * n, arm, cls.max_new_tokens, sampling)
            out[f"{kind} {arm}"] = {"prompt_tokens": round(sum(map(len, prompts)) / len(prompts), 1),
                                    **tally.summary(len(prompts), "request")}
    return {"device": device_name(engine), "class": cls.name, "n": n, "requests": requests,
            "max_new_tokens": cls.max_new_tokens, "identical_outputs": identical, "cases": out}


def bench_lengths(engine: SpeculativeEngine, classes: dict[str, RequestClass], arms: list[Arm], size: int,
                  batches: int) -> dict:
    """Each arm serves `batches` batches of `size` requests, every class's prompts in turn (so
    lengths mix as in a burst of every class; greedy and sampled by their classes), prefilled
    in groups of similar length and in one forward; the outputs must be identical."""
    names = list(classes)
    picked = [classes[names[j % len(names)]] for j in range(size)]
    limits = [cls.max_new_tokens for cls in picked]
    sampling = [SamplingParams(cls.temperature, cls.top_p, seed=j) for j, cls in enumerate(picked)]
    batched = [[engine.encode(cls.prompts[(i * size + j) % len(cls.prompts)]).tolist() for j, cls in enumerate(picked)]
               for i in range(batches)]
    padding = sum(len(p) * max(map(len, p)) / sum(map(len, p)) for p in batched) / batches
    out, identical = {}, True
    for arm in arms:
        tally = _Tally({"grouped": contextlib.nullcontext, "one forward": _one_forward})
        for i, prompts in enumerate(batched):
            identical &= tally.serve(engine, i, prompts, arm, limits, sampling)
        out[str(arm)] = {"padded_over_real_tokens": round(padding, 2), **tally.summary(batches, "batch")}
    return {"device": device_name(engine), "classes": names, "batch": size, "batches": batches,
            "identical_outputs": identical, "arms": out}
