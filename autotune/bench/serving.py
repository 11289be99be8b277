"""`autotune bench serve`: what the HTTP server costs, against the same clients calling the
controller in the same process. The HTTP clients run in a process of their own, as real
clients do: in the server's process their own Python work would compete with the decode loop
for the GIL and be counted as the server's."""

from __future__ import annotations

import json
import multiprocessing
import statistics
import time
import urllib.parse
import urllib.request
from collections import defaultdict

import numpy as np
import psutil
import scipy.stats

from autotune.bench.common import client_plan, device_name, p99, rotate, run_clients
from autotune.bench.concurrency import FirstOutput
from autotune.control.controller import AutotuneController, default_arms
from autotune.data.classes import RequestClass
from autotune.serve.server import CompletionServer
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


def _client_process(base: str, bodies: list[list[dict]], pipe) -> None:
    """The HTTP clients, in a process of their own: at each "go", client c sends `bodies[c]` one
    after another on a thread of its own; the round's seconds and, per client, each request's
    (tokens, latency, time to first token, text) go back, or the error of a client that failed
    (a process that died of it would leave the benchmark waiting for its answer forever)."""
    pipe.send("ready")  # imported: from here on it spends no CPU until told to go
    while pipe.recv() == "go":
        served: list[list[tuple]] = [[] for _ in bodies]

        def client(c: int, served=served) -> None:
            for body in bodies[c]:
                start = time.perf_counter()
                text, tokens, first = _post_streamed(base, body)
                done = time.perf_counter()
                served[c].append((tokens, done - start, (first or done) - start, text))

        try:
            pipe.send((run_clients(client, len(bodies)), served))
        except RuntimeError as exc:  # as text: an HTTPError holds its response, which does not pickle
            pipe.send(RuntimeError(f"{exc}: {exc.__cause__!r}"))


def _server_process(base: str) -> psutil.Process | None:
    """The process on this machine that listens at `base`'s port, whose CPU time a round is
    charged; None for a server elsewhere, or one whose sockets this user may not read."""
    url = urllib.parse.urlsplit(base)
    if url.hostname not in ("127.0.0.1", "localhost", "::1"):
        return None
    try:
        listening = [c.pid for c in psutil.net_connections("tcp")
                     if c.status == psutil.CONN_LISTEN and c.laddr.port == url.port and c.pid]
    except psutil.AccessDenied:
        return None
    return psutil.Process(listening[0]) if listening else None


def _cpu_seconds(process: psutil.Process) -> float:
    """User and system seconds the process has run on every thread, those ended included (its
    child processes, such as a llama.cpp backend's servers, not)."""
    times = process.cpu_times()
    return times.user + times.system


def _pairs(names: list[str]) -> list[tuple[str, str]]:
    """The configurations compared round by round: for names "new-X" and "old-X" (servers given as
    `others`), new over old; for a policy served in process, over HTTP over directly."""
    pairs = [(name, "old-" + name[4:]) for name in names if name.startswith("new-") and "old-" + name[4:] in names]
    return pairs + [(name, name[:-4] + "direct") for name in names if name.endswith("/http")]


def _rounds_interval(ratios: list[float]) -> dict | None:
    """The round ratios' geometric mean and its 95 % interval, bootstrapped over the rounds: how
    far a run's verdict can be trusted when rounds move more than the servers differ."""
    if len(ratios) < 2 or len(set(ratios)) < 2:
        return None
    logs = np.log(ratios)
    interval = scipy.stats.bootstrap((logs,), np.mean, method="percentile", random_state=0).confidence_interval
    return {"geometric_mean": round(float(np.exp(logs.mean())), 3),
            "interval_95": [round(float(np.exp(interval.low)), 3), round(float(np.exp(interval.high)), 3)]}


def _compared(one: dict, other: dict) -> dict:
    """`one` configuration's figures over `other`'s: in all, and tokens/s round by round (rounds
    served minutes apart see the machine at different speeds; one round's pair saw it alike)."""
    cpu = (one["server_cpu_ms_per_token"], other["server_cpu_ms_per_token"])
    by_round = [round(x / y, 3) for x, y in zip(one["tokens_per_s_by_round"], other["tokens_per_s_by_round"])]
    return {"tokens_per_s": round(one["tokens_per_s"] / other["tokens_per_s"], 3),
            "ttft_s_p99": round(one["ttft_s_p99"] / other["ttft_s_p99"], 3),
            "server_cpu_per_token": round(cpu[0] / cpu[1], 3) if None not in cpu else None,
            "tokens_per_s_by_round": by_round,
            "tokens_per_s_over_rounds": _rounds_interval(by_round)}


def bench_serve(engine: SpeculativeEngine, classes: dict[str, RequestClass], clients: int = 16,
                requests_per_client: int = 4, max_batch: int = 16, policies: tuple[str, ...] = ("off", "ucb"),
                rounds: int = 2, others: dict[str, str] | None = None, progress=print) -> dict:
    """Clients on threads, each sending its requests one after another, streamed, to a controller
    (coalescing, continuous batching) called in process (`direct`) or through `autotune serve`'s
    server on localhost (`http`: JSON in, server-sent events out, the clients in a process of
    their own). Client c sends requests of
    class c mod len(classes), the same in every configuration; configurations take turns round
    by round and keep their controllers across rounds. Greedy texts must be identical in all.
    Latency: from sending a request to having its whole output; time to first token: to its
    first output text. `others` (name -> base URL): servers started elsewhere (another
    build of `autotune serve`, or any OpenAI-compatible server of the same model), served by
    the same clients in the same turns. Server CPU per token: the seconds a server's process ran
    (user and system, every thread) during its configuration's rounds, over the tokens they
    served: the work a front end adds, beside what tokens/s shows of it. For `http`
    configurations and servers on this machine; none for `direct` (the clients' threads share
    its process)."""
    plan = client_plan(engine, classes, clients, requests_per_client)
    bodies = [[{"prompt": ids, "request_class": cls.name, "max_tokens": cls.max_new_tokens,
                "temperature": cls.temperature, "top_p": cls.top_p, "seed": c * 1000 + j, "stream": True,
                "stream_options": {"include_usage": True}} for j, ids in enumerate(requests)]
              for c, (cls, requests) in enumerate(plan)]
    arms = default_arms(engine)
    controllers, servers, bases, pipes, processes = {}, {}, {}, {}, []
    spawn = multiprocessing.get_context("spawn")  # a fresh interpreter: no copy of this one's threads
    for p in policies:
        for how in ("direct", "http"):
            controllers[f"{p}/{how}"] = AutotuneController(engine, policy=p, arms=arms, max_batch=max_batch)
        server = servers[f"{p}/http"] = CompletionServer(controllers[f"{p}/http"], ("127.0.0.1", 0)).start()
        bases[f"{p}/http"] = f"http://127.0.0.1:{server.server_port}"
    for name, base in {**bases, **(others or {})}.items():
        pipes[name], theirs = spawn.Pipe()
        processes.append(spawn.Process(target=_client_process, args=(base.rstrip("/"), bodies, theirs), daemon=True))
        processes[-1].start()
    for pipe in pipes.values():  # no round may share the CPU with a client process starting up
        assert pipe.recv() == "ready"
    # whose CPU a configuration's rounds are charged: a server's process; in process, the clients'
    # threads would be counted with the controller's, so none
    processes_served = {**{name: psutil.Process() for name in bases},
                        **{name: _server_process(base) for name, base in (others or {}).items()}}
    stats = {name: {"seconds": 0.0, "served": [], "rounds": [], "cpu_s": 0.0}
             for name in [*controllers, *(others or {})]}
    greedy: dict[tuple[int, int], set] = defaultdict(set)
    try:
        for r in range(rounds):
            for name in rotate(list(stats), r):
                ctl, s = controllers.get(name), stats[name]
                process = processes_served.get(name)
                cpu_before = _cpu_seconds(process) if process else 0.0
                if name in pipes:
                    pipes[name].send("go")
                    answer = pipes[name].recv()
                    if isinstance(answer, Exception):
                        raise answer
                    seconds, served = answer
                else:
                    served = [[] for _ in plan]

                    def client(c, ctl=ctl, served=served):
                        cls, requests = plan[c]
                        for j, ids in enumerate(requests):
                            start, streamer = time.perf_counter(), FirstOutput()
                            out = ctl.generate(ids, cls.name, cls.max_new_tokens, cls.temperature, cls.top_p,
                                               seed=c * 1000 + j, streamer=streamer)
                            done = time.perf_counter()
                            served[c].append((out.metrics.new_tokens, done - start, (streamer.at or done) - start,
                                              out.text))

                    seconds = run_clients(client, clients)
                s["seconds"] += seconds
                if process:
                    s["cpu_s"] += _cpu_seconds(process) - cpu_before
                s["rounds"].append(sum(row[0] for rows in served for row in rows) / seconds)
                for c, rows in enumerate(served):
                    for j, (tokens, latency, ttft, text) in enumerate(rows):
                        s["served"].append((tokens, latency, ttft))
                        if plan[c][0].temperature == 0:
                            greedy[c, j].add(text)
                tokens = sum(row[0] for row in s["served"])
                progress(f"  round {r + 1}/{rounds} {name}: {tokens / s['seconds']:.0f} tokens/s so far")
    finally:
        for pipe in pipes.values():
            pipe.send("stop")
        for process in processes:
            process.join(timeout=10)
        for server in servers.values():
            server.shutdown()
    out = {}
    for name, s in stats.items():
        tokens, latency, ttft = zip(*s["served"])
        cpu_ms = round(1000 * s["cpu_s"] / sum(tokens), 3) if processes_served.get(name) else None
        out[name] = {"tokens_per_s": round(sum(tokens) / s["seconds"], 1),
                     "tokens_per_s_by_round": [round(t, 1) for t in s["rounds"]],
                     "latency_s_p50": round(statistics.median(latency), 3), "latency_s_p99": p99(latency),
                     "ttft_s_p50": round(statistics.median(ttft), 3), "ttft_s_p99": p99(ttft),
                     "server_cpu_ms_per_token": cpu_ms}
    return {"device": device_name(engine), "clients": clients, "requests_per_client": requests_per_client,
            "rounds": rounds, "max_batch": max_batch, "configs": out,
            "http_vs_direct": {p: round(out[f"{p}/http"]["tokens_per_s"] / out[f"{p}/direct"]["tokens_per_s"], 3)
                               for p in policies},
            "http_vs_others": {name: {p: {key: round(out[f"{p}/http"][key] / out[name][key], 3)
                                          for key in ("tokens_per_s", "ttft_s_p99")} for p in policies}
                               for name in others or {}},
            "compared": {f"{a} over {b}": _compared(out[a], out[b]) for a, b in _pairs(list(stats))},
            "greedy_requests_compared": len(greedy),
            "identical_greedy_outputs": all(len(v) == 1 for v in greedy.values())}
