"""`autotune bench serve`: what the HTTP server costs, against the same clients calling the
controller in the same process."""

from __future__ import annotations

import json
import statistics
import threading
import time
import urllib.request
from collections import defaultdict

from autotune.bench.common import client_plan, device_name, p99, rotate, run_clients
from autotune.bench.concurrency import FirstOutput
from autotune.classes import RequestClass
from autotune.controller import AutotuneController, default_arms
from autotune.server import CompletionServer
from engine import SpeculativeEngine


def _post_streamed(base: str, body: dict) -> tuple[str, int, float]:
    """A streamed completion: its text, its completion tokens (the usage chunk) and when its
    first text arrived."""
    request = urllib.request.Request(base + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    text, tokens, first = [], 0, None
    with urllib.request.urlopen(request) as response:
        for line in response:
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[6:])
            if event["choices"] and event["choices"][0]["text"]:
                first = first or time.perf_counter()
                text.append(event["choices"][0]["text"])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    return "".join(text), tokens, first


def bench_serve(engine: SpeculativeEngine, classes: dict[str, RequestClass], clients: int = 16,
                requests_per_client: int = 4, max_batch: int = 16, policies: tuple[str, ...] = ("off", "ucb"),
                rounds: int = 2, progress=print) -> dict:
    """Clients on threads, each sending its requests one after another, streamed, to a controller
    (coalescing, continuous batching) called in process (`direct`) or through `autotune serve`'s
    server on localhost (`http`: JSON in, server-sent events out). Client c sends requests of
    class c mod len(classes), the same in every configuration; configurations take turns round
    by round and keep their controllers across rounds. Greedy texts must be identical in all.
    Latency: from sending a request to having its whole output; time to first token: to its
    first output text."""
    plan = client_plan(engine, classes, clients, requests_per_client)
    arms = default_arms(engine)
    controllers, servers = {}, {}
    for p in policies:
        for how in ("direct", "http"):
            controllers[f"{p}/{how}"] = AutotuneController(engine, policy=p, arms=arms, max_batch=max_batch)
        server = servers[f"{p}/http"] = CompletionServer(controllers[f"{p}/http"], ("127.0.0.1", 0))
        threading.Thread(target=server.serve_forever, daemon=True).start()
    stats = {name: {"seconds": 0.0, "served": []} for name in controllers}  # (tokens, latency, ttft)
    greedy: dict[tuple[int, int], set] = defaultdict(set)
    try:
        for r in range(rounds):
            for name in rotate(list(controllers), r):
                ctl, s, server = controllers[name], stats[name], servers.get(name)

                def client(c, ctl=ctl, s=s, server=server):
                    cls, requests = plan[c]
                    for j, ids in enumerate(requests):
                        start = time.perf_counter()
                        if server is None:
                            streamer = FirstOutput()
                            out = ctl.generate(ids, cls.name, cls.max_new_tokens, cls.temperature, cls.top_p,
                                               seed=c * 1000 + j, streamer=streamer)
                            text, tokens, first = out.text, out.metrics.new_tokens, streamer.at
                        else:
                            text, tokens, first = _post_streamed(
                                f"http://127.0.0.1:{server.server_port}",
                                {"prompt": ids, "request_class": cls.name, "max_tokens": cls.max_new_tokens,
                                 "temperature": cls.temperature, "top_p": cls.top_p, "seed": c * 1000 + j,
                                 "stream": True, "stream_options": {"include_usage": True}})
                        done = time.perf_counter()
                        s["served"].append((tokens, done - start, (first or done) - start))  # one append: atomic
                        if cls.temperature == 0:
                            greedy[c, j].add(text)

                s["seconds"] += run_clients(client, clients)
                tokens = sum(row[0] for row in s["served"])
                progress(f"  round {r + 1}/{rounds} {name}: {tokens / s['seconds']:.0f} tokens/s so far")
    finally:
        for server in servers.values():
            server.shutdown()
            server.server_close()
    out = {}
    for name, s in stats.items():
        tokens, latency, ttft = zip(*s["served"])
        out[name] = {"tokens_per_s": round(sum(tokens) / s["seconds"], 1),
                     "latency_s_p50": round(statistics.median(latency), 3), "latency_s_p99": p99(latency),
                     "ttft_s_p50": round(statistics.median(ttft), 3), "ttft_s_p99": p99(ttft)}
    return {"device": device_name(engine), "clients": clients, "requests_per_client": requests_per_client,
            "rounds": rounds, "max_batch": max_batch, "configs": out,
            "http_vs_direct": {p: round(out[f"{p}/http"]["tokens_per_s"] / out[f"{p}/direct"]["tokens_per_s"], 3)
                               for p in policies},
            "greedy_requests_compared": len(greedy),
            "identical_greedy_outputs": all(len(v) == 1 for v in greedy.values())}
