"""How a batch prefills its rows, each way against the one before, the same requests both ways.

`autotune bench choices`: a request's n sampled choices (vLLM's and OpenAI's `n`; best-of-n and
self-consistency sampling ask for them) with their prompt prefilled once and shared, against
every choice prefilling it. `autotune bench lengths`: rows of mixed lengths (a burst of every
class) prefilled in groups of similar length, against all in one forward padded to the longest.
"""

from __future__ import annotations

import contextlib
import functools
import time
from unittest import mock

import engine.batch as engine_batch
from autotune.bench.common import device_name, rotate
from autotune.classes import RequestClass
from engine import Arm, SamplingParams, SpeculativeEngine

MODES = ("shared", "every choice")


@contextlib.contextmanager
def _sharing(share: bool):
    with mock.patch.object(engine_batch, "prefilled", functools.partial(engine_batch.prefilled, share=share)):
        yield


@contextlib.contextmanager
def _grouping(grouped: bool):
    """Rows prefilled in groups of similar length (the engine's way), or all in one forward."""
    if grouped:
        yield
        return
    with mock.patch.object(engine_batch, "length_groups", lambda lengths: [list(range(len(lengths)))]):
        yield


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
    for every choice, taking turns; the outputs must be identical."""
    prompt_sets = {"workload": [engine.encode(p).tolist() for p in cls.prompts[:requests]],
                   f"{long_tokens} tokens": long_prompts(engine, cls, long_tokens, requests)}
    out, identical = {}, True
    for kind, prompts in prompt_sets.items():
        for arm in arms:
            seconds, prefill, tokens = dict.fromkeys(MODES, 0.0), dict.fromkeys(MODES, 0.0), dict.fromkeys(MODES, 0)
            for i, prompt in enumerate(prompts):
                sampling = [SamplingParams(cls.temperature, cls.top_p, seed=j) for j in range(n)]
                outputs = []
                for mode in rotate(list(MODES), i):
                    with _sharing(mode == "shared"):
                        began = time.perf_counter()
                        served = engine.generate_batch([prompt] * n, arm, cls.max_new_tokens, sampling)
                        seconds[mode] += time.perf_counter() - began
                    prefill[mode] += served.metrics.prefill_s
                    tokens[mode] += served.metrics.new_tokens
                    outputs.append([r.tokens for r in served])
                identical &= outputs[0] == outputs[1]
            tps = {m: tokens[m] / seconds[m] for m in MODES}
            out[f"{kind} {arm}"] = {
                "prompt_tokens": round(sum(map(len, prompts)) / len(prompts), 1),
                "tokens_per_s": {m: round(v, 1) for m, v in tps.items()},
                "prefill_s_per_request": {m: round(prefill[m] / len(prompts), 4) for m in MODES},
                "shared_vs_every_choice": round(tps["shared"] / tps["every choice"], 3),
            }
    return {"device": device_name(engine), "class": cls.name, "n": n, "requests": requests,
            "max_new_tokens": cls.max_new_tokens, "identical_outputs": identical, "cases": out}


GROUPINGS = ("grouped", "one forward")


def bench_lengths(engine: SpeculativeEngine, classes: dict[str, RequestClass], arms: list[Arm], size: int,
                  batches: int) -> dict:
    """Each arm serves `batches` batches of `size` requests, every class's prompts in turn (so
    lengths mix as in a burst of every class; greedy and sampled by their classes), prefilled
    in groups of similar length and in one forward, taking turns; the outputs must be identical."""
    names = list(classes)
    out, identical = {}, True
    for arm in arms:
        seconds, prefill, tokens = (dict.fromkeys(GROUPINGS, 0.0), dict.fromkeys(GROUPINGS, 0.0),
                                    dict.fromkeys(GROUPINGS, 0))
        padding = []
        for i in range(batches):
            picked = [classes[names[j % len(names)]] for j in range(size)]
            prompts = [engine.encode(cls.prompts[(i * size + j) % len(cls.prompts)]).tolist()
                       for j, cls in enumerate(picked)]
            limits = [cls.max_new_tokens for cls in picked]
            sampling = [SamplingParams(cls.temperature, cls.top_p, seed=j) for j, cls in enumerate(picked)]
            padding.append(len(prompts) * max(map(len, prompts)) / sum(map(len, prompts)))
            outputs = []
            for grouping in rotate(list(GROUPINGS), i):
                with _grouping(grouping == "grouped"):
                    began = time.perf_counter()
                    served = engine.generate_batch(prompts, arm, limits, sampling)
                    seconds[grouping] += time.perf_counter() - began
                prefill[grouping] += served.metrics.prefill_s
                tokens[grouping] += served.metrics.new_tokens
                outputs.append([r.tokens for r in served])
            identical &= outputs[0] == outputs[1]
        tps = {g: tokens[g] / seconds[g] for g in GROUPINGS}
        out[str(arm)] = {
            "padded_over_real_tokens": round(sum(padding) / len(padding), 2),
            "tokens_per_s": {g: round(v, 1) for g, v in tps.items()},
            "prefill_s_per_batch": {g: round(prefill[g] / batches, 4) for g in GROUPINGS},
            "grouped_vs_one_forward": round(tps["grouped"] / tps["one forward"], 3),
        }
    return {"device": device_name(engine), "classes": names, "batch": size, "batches": batches,
            "identical_outputs": identical, "arms": out}
