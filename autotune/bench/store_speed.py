"""`autotune bench store`: what recording costs on the request path, and what writing it costs."""

from __future__ import annotations

import math
import statistics
import time

from store import Store


def bench_store(url: str, n: int = 5000) -> dict:
    """Cost of `record()` and `record_update()` on the request path (they only enqueue), and of
    writing them (a flush), on a fresh store at `url`."""
    with Store(url) as store:
        times = []
        for i in range(n):
            start = time.perf_counter()
            store.record(request_class="code", arm="small:4", prompt_tokens=100, new_tokens=64, goodput=100.0 + i,
                         acceptance=0.7, acceptance_per_position=[0.9, 0.8, 0.7, 0.6], features={"load": 1})
            store.record_update(seq=i + 1, policy="ucb", request_class="code", load=1, features={"load": 1},
                                arm="small:4", goodput=100.0 + i, reward=1.1, acceptance=0.7, new_tokens=64,
                                siblings={"small:2": [1.05, 0.5]})
            times.append(time.perf_counter() - start)
        start = time.perf_counter()
        store.flush()
        flush_s = time.perf_counter() - start
    times.sort()
    return {"records": n, "record_us_p50": round(times[n // 2] * 1e6, 2),
            "record_us_p99": round(times[int(n * 0.99)] * 1e6, 2),
            "record_us_mean": round(statistics.fmean(times) * 1e6, 2), "flush_all_s": round(flush_s, 4),
            "rows_per_s_written": round(2 * n / flush_s if flush_s > 0 else math.inf)}
