"""`autotune bench concurrency`: client threads calling the controller at once, served one at a
time, in static batches, or continuously batched."""

from __future__ import annotations

import statistics
import time
from collections import defaultdict

from autotune.bench.common import client_plan, device_name, p99, rotate, run_clients
from autotune.control.controller import AutotuneController, default_arms
from autotune.data.classes import RequestClass
from engine import SpeculativeEngine


class FirstOutput:
    """A streamer that notes when a request's first output token arrives (time to first token)."""

    def __init__(self) -> None:
        self.puts, self.at = 0, None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:  # the first put is the prompt
            self.at = time.perf_counter()

    def end(self) -> None:
        pass


def bench_concurrency(engine: SpeculativeEngine, classes: dict[str, RequestClass], clients: int = 16,
                      requests_per_client: int = 4, max_batch: int = 16, policies: tuple[str, ...] = ("off", "ucb"),
                      rounds: int = 2, progress=print) -> dict:
    """Clients on threads, each sending its requests one after another, through a controller that
    serves them one at a time (max_batch 1) or coalesces those waiting together into batches of
    every class waiting: static (`static`: continuous=False, a request arriving while a batch
    decodes waits for it to end) or continuous (`continuous`, the controller's default: it joins
    the batch at the next round, every request returns when it is done, and the policy decides
    again every `decide_every` rounds; a request decoding alone pauses when another arrives and
    finishes in a batch with it, which `continuous-nopause` turns off).

    Client c sends requests of class c mod len(classes). Every configuration (policy x batching)
    serves the same requests, configurations taking turns round by round; each keeps its
    controller (and what it learned) across rounds. Greedy outputs must be identical everywhere.
    Latency is from a client sending a request to its result; time to first token, to the
    first output token its streamer got; queue, the controller's `queue_s` (until the engine
    began on it).
    """
    plan = client_plan(engine, classes, clients, requests_per_client)
    arms = default_arms(engine)
    controllers = {}
    for p in policies:
        controllers[f"{p}/batch1"] = AutotuneController(engine, policy=p, arms=arms)
        for how, continuous, pause in (("static", False, False), ("continuous", True, True),
                                       ("continuous-nopause", True, False)):
            controllers[f"{p}/batch{max_batch}-{how}"] = AutotuneController(
                engine, policy=p, arms=arms, max_batch=max_batch, continuous=continuous, pause_alone=pause)
    stats = {name: {"seconds": 0.0, "served": []} for name in controllers}  # (tokens, latency, ttft, queue, load)
    greedy: dict[tuple[int, int], set] = defaultdict(set)
    for r in range(rounds):
        for name in rotate(list(controllers), r):
            ctl, s = controllers[name], stats[name]

            def client(c, ctl=ctl, s=s):
                cls, requests = plan[c]
                for j, ids in enumerate(requests):
                    first = FirstOutput()
                    start = time.perf_counter()
                    out = ctl.generate(ids, cls.name, cls.max_new_tokens, cls.temperature, cls.top_p, seed=c * 1000 + j,
                                       streamer=first)
                    s["served"].append((out.metrics.new_tokens, time.perf_counter() - start, first.at - start,
                                        out.queue_s, out.load))  # one append: atomic
                    if cls.temperature == 0:
                        greedy[c, j].add(tuple(out.tokens))

            s["seconds"] += run_clients(client, clients)
            tokens = sum(row[0] for row in s["served"])
            progress(f"  round {r + 1}/{rounds} {name}: {tokens / s['seconds']:.0f} tokens/s so far")
    out = {}
    for name, s in stats.items():
        tokens, latency, ttft, queued, loads = zip(*s["served"])
        out[name] = {"tokens_per_s": round(sum(tokens) / s["seconds"], 1),
                     "latency_s_p50": round(statistics.median(latency), 3), "latency_s_p99": p99(latency),
                     "ttft_s_p50": round(statistics.median(ttft), 3), "ttft_s_p99": p99(ttft),
                     "queue_s_p50": round(statistics.median(queued), 3), "queue_s_p99": p99(queued),
                     "mean_load": round(statistics.fmean(loads), 2)}
    tps = {name: v["tokens_per_s"] for name, v in out.items()}

    def ratio(a: str, b: str) -> float:
        return round(tps[a] / tps[b], 3)

    return {"device": device_name(engine), "clients": clients, "requests_per_client": requests_per_client,
            "rounds": rounds, "max_batch": max_batch, "configs": out,
            "coalesced_vs_one_at_a_time": {f"{p}/{how}": ratio(f"{p}/batch{max_batch}-{how}", f"{p}/batch1")
                                           for p in policies for how in ("static", "continuous")},
            "continuous_vs_static": {p: ratio(f"{p}/batch{max_batch}-continuous", f"{p}/batch{max_batch}-static")
                                     for p in policies},
            "pause_vs_nopause": {p: ratio(f"{p}/batch{max_batch}-continuous",
                                          f"{p}/batch{max_batch}-continuous-nopause") for p in policies},
            "identical_greedy_outputs": all(len(v) == 1 for v in greedy.values())}
