"""`autotune bench cache`: the engine's growing KV cache against transformers' DynamicCache,
alone and in batches, the same requests on both."""

from __future__ import annotations

import contextlib
import time
from unittest import mock

from transformers import DynamicCache

import engine.batch as engine_batch
import engine.runner as engine_runner
from autotune.bench.common import device_name, rotate
from autotune.classes import RequestClass
from engine import Arm, SamplingParams, SpeculativeEngine
from engine.kvcache import GrowingCache


@contextlib.contextmanager
def _eager_cache(cache_class):
    """Serve with `cache_class(config)` as the eager KV cache of single requests and batches."""
    with mock.patch.object(engine_runner, "GrowingCache", cache_class), \
            mock.patch.object(engine_batch, "GrowingCache", cache_class):
        yield


def bench_cache(engine: SpeculativeEngine, classes: dict[str, RequestClass],
                cases: list[tuple[int, str, Arm, int]]) -> dict:
    """The engine's eager KV cache (GrowingCache) against transformers' DynamicCache, which copies
    the whole cache into a new tensor every step. Each case (batch size, class, arm, repeats)
    serves `repeats` batches (size 1: single requests; different prompts while the class has
    them) with both caches, taking turns; outputs must be identical."""
    caches = {"dynamic": lambda config: DynamicCache(config=config), "growing": GrowingCache}
    out, identical = {}, True
    for size, name, arm, repeats in cases:
        cls = classes[name]
        seconds, tokens = dict.fromkeys(caches, 0.0), dict.fromkeys(caches, 0)
        for i in range(repeats):
            start = i * size % max(1, len(cls.prompts) - size + 1)  # the class's prompts again once used up
            prompts = [engine.encode(p).tolist() for p in cls.prompts[start:start + size]]
            sampling = [SamplingParams(cls.temperature, cls.top_p, seed=j) for j in range(size)]
            outputs = []
            for cache in rotate(list(caches), i):
                with _eager_cache(caches[cache]):
                    began = time.perf_counter()
                    if size == 1:  # the single-request path, which crops rejected drafts
                        served = [engine.generate(prompts[0], arm, cls.max_new_tokens, sampling[0])]
                    else:
                        served = engine.generate_batch(prompts, arm, cls.max_new_tokens, sampling).results
                    seconds[cache] += time.perf_counter() - began
                tokens[cache] += sum(r.metrics.new_tokens for r in served)
                outputs.append([r.tokens for r in served])
            identical &= outputs[0] == outputs[1]
        tps = {c: tokens[c] / seconds[c] for c in caches}
        out[f"batch {size} {name} {arm}"] = {"repeats": repeats,
                                             "tokens_per_s": {c: round(v, 1) for c, v in tps.items()},
                                             "growing_vs_dynamic": round(tps["growing"] / tps["dynamic"], 3)}
    return {"device": device_name(engine), "identical_outputs": identical, "cases": out}
