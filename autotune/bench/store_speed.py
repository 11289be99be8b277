"""`autotune bench store`: what recording an observation costs on the request path."""

from __future__ import annotations

import math
import statistics
import time

from store import Store


def bench_store(n: int = 5000) -> dict:
    """Cost of `record()` on the request path (it only enqueues), and of a flush."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp, Store(f"sqlite:///{tmp}/bench.db") as store:
        times = []
        for i in range(n):
            start = time.perf_counter()
            store.record(request_class="code", arm="small:4", prompt_tokens=100, new_tokens=64, goodput=100.0 + i,
                         acceptance=0.7, acceptance_per_position=[0.9, 0.8, 0.7, 0.6], features={"load": 1})
            times.append(time.perf_counter() - start)
        start = time.perf_counter()
        store.flush()
        flush_s = time.perf_counter() - start
    times.sort()
    return {"records": n, "record_us_p50": round(times[n // 2] * 1e6, 2),
            "record_us_p99": round(times[int(n * 0.99)] * 1e6, 2),
            "record_us_mean": round(statistics.fmean(times) * 1e6, 2), "flush_all_s": round(flush_s, 4),
            "rows_per_s_written": round(n / flush_s if flush_s > 0 else math.inf)}
