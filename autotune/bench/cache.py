"""`autotune bench cache`: the engine's growing KV cache against transformers' DynamicCache,
alone and in batches, the same requests on both. `autotune bench longrun`: a batch kept busy
for long, its caches dropping their holes against keeping them."""

from __future__ import annotations

import contextlib
import time
from unittest import mock

from transformers import DynamicCache

import engine.batch as engine_batch
import engine.runner as engine_runner
from autotune.bench.common import device_name, rotate
from autotune.data.classes import RequestClass
from engine import Arm, BatchRequest, SamplingParams, SpeculativeEngine
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


def bench_long_batch(engine: SpeculativeEngine, classes: dict[str, RequestClass], arms: list[Arm], rows: int = 16,
                     requests: int = 320, rounds: int = 2) -> dict:
    """One batch session kept busy, as a server's is under steady load: `rows` requests decode and
    each one done is replaced by the next, `requests` in all (every class's prompts in turn,
    with its sampling and max_new_tokens), the caches dropping their holes (BatchCache.compact)
    and keeping them (as before), taking turns. Reported: tokens/s over all the requests and
    from when the last quarter of them began to join (tokens the rounds committed), the most
    slots the target's cache held, and the rounds; outputs must be identical."""
    names = list(classes)
    picked = [classes[names[i % len(names)]] for i in range(requests)]
    prompts = [engine.encode(cls.prompts[i // len(names) % len(cls.prompts)]).tolist() for i, cls in enumerate(picked)]
    sampling = [SamplingParams(cls.temperature, cls.top_p, seed=i) for i, cls in enumerate(picked)]
    ways = {"compacted": contextlib.nullcontext,
            "holes kept": lambda: mock.patch.object(engine_batch, "COMPACT_SLACK", 1 << 62)}
    out, identical = {}, True
    for arm in arms:
        stats = {way: {"seconds": 0.0, "tokens": 0, "late_seconds": 0.0, "late_tokens": 0, "slots": 0, "rounds": 0}
                 for way in ways}
        for r in range(rounds):
            outputs = []
            for way in rotate(list(ways), r):
                s, done = stats[way], {}
                with ways[way]():
                    session = engine.open_batch(arm)
                    began = time.perf_counter()
                    session.add([BatchRequest(prompts[i], picked[i].max_new_tokens, sampling[i]) for i in range(rows)])
                    added, late = rows, None  # late: (when, tokens committed) once 3/4 of the requests were added
                    while True:
                        finished = session.finished()
                        done.update((i, result.tokens) for i, result in finished)
                        more = range(added, min(requests, added + len(finished)))
                        session.add([BatchRequest(prompts[i], picked[i].max_new_tokens, sampling[i]) for i in more])
                        added += len(more)
                        if late is None and added >= 3 * requests // 4:
                            late = (time.perf_counter(), session.committed)
                        if not session.live_rows:
                            break
                        session.step()
                        s["slots"] = max(s["slots"], session._run.target_cache.slots)
                        s["rounds"] += 1
                    end = time.perf_counter()
                s["seconds"] += end - began
                s["tokens"] += sum(map(len, done.values()))
                s["late_seconds"] += end - late[0]
                s["late_tokens"] += session.committed - late[1]
                outputs.append([done[i] for i in range(requests)])
            identical &= outputs[0] == outputs[1]
        tps = {w: s["tokens"] / s["seconds"] for w, s in stats.items()}
        late_tps = {w: s["late_tokens"] / s["late_seconds"] for w, s in stats.items()}
        out[str(arm)] = {"tokens_per_s": {w: round(v, 1) for w, v in tps.items()},
                         "last_quarter_tokens_per_s": {w: round(v, 1) for w, v in late_tps.items()},
                         "compacted_vs_holes_kept": round(tps["compacted"] / tps["holes kept"], 3),
                         "last_quarter_compacted_vs_holes_kept": round(
                             late_tps["compacted"] / late_tps["holes kept"], 3),
                         "most_slots": {w: s["slots"] for w, s in stats.items()},
                         "rounds": {w: s["rounds"] // rounds for w, s in stats.items()}}
    return {"device": device_name(engine), "rows": rows, "requests": requests, "rounds": rounds,
            "identical_outputs": identical, "arms": out}
