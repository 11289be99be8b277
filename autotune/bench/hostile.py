"""`autotune bench hostile`: `autotune serve` under requests meant to hurt it.

A server process over the committed family (from the code at $PYTHONPATH, so an older checkout
can be measured the same way), in a session of its own as a deployed server is, then: a 30 MB
prompt, a 10 MB /tokenize, and `classes` distinct request classes, each request timed with the
server's resident memory before and after, and the size and time of /metrics and
/v1/autotune/policy once the classes are in. Last, `idle` connections that send nothing and
`slow` clients that send a request's head a byte a second, held (and reopened when the server
closes them) from two processes of their own, while normal requests are timed against the same
requests on the quiet server: one a second from the attack's start for `held_s` (its flood of
connects, the connections held, the head deadline's closes and the attackers' reopening), then
ten each on a connection of its own and ten one after another on one kept-alive connection;
then SIGTERM, with all of them still there.
"""

from __future__ import annotations

import http.client
import json
import multiprocessing
import os
import resource
import selectors
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import psutil


def _rss_mb(process: psutil.Process) -> int:
    return round(process.memory_info().rss / 2**20)


def _autogroup_enabled() -> bool | None:
    """Whether the kernel groups each session's threads for CPU time (Linux's autogroup); None elsewhere."""
    try:
        with open("/proc/sys/kernel/sched_autogroup_enabled") as f:
            return f.read().strip() == "1"
    except OSError:
        return None


def _call(url: str, body: dict | None = None, timeout: float = 600) -> tuple[int, float, int]:
    """(status, seconds, bytes of the answer) of a GET, or a POST of `body`; status 0: no answer in time."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            status, size = response.status, len(response.read())
    except urllib.error.HTTPError as exc:
        status, size = exc.code, len(exc.read())
    except OSError:  # refused, reset or timed out
        status, size = 0, 0
    return status, round(time.perf_counter() - start, 3), size


def _connection(base: str, timeout: float) -> http.client.HTTPConnection:
    host, port = base.removeprefix("http://").split(":")
    return http.client.HTTPConnection(host, int(port), timeout=timeout)


def _kept_alive(base: str, body: dict, count: int) -> list[float]:
    """Seconds of `count` POSTs of `body` one after another on one kept-alive connection, as a
    client with a connection pool (the OpenAI SDK's httpx) sends them."""
    connection = _connection(base, timeout=30)
    seconds = []
    try:
        for _ in range(count):
            start = time.perf_counter()
            # bytes: head and body in one send (a str body goes in a second, which Nagle holds for the ACK)
            connection.request("POST", "/v1/completions", json.dumps(body).encode(),
                               {"Content-Type": "application/json"})
            connection.getresponse().read()
            seconds.append(round(time.perf_counter() - start, 3))
    finally:
        connection.close()
    return seconds


def _head_answer(base: str, path: str, length: int) -> tuple[int, float]:
    """(status, seconds) of a POST whose head states `length` bytes, read before its body is sent
    (as a client sending `Expect: 100-continue` would): a server that refuses a body unread
    answers here, and closes the connection on a client still sending it."""
    connection = _connection(base, timeout=60)
    start = time.perf_counter()
    connection.putrequest("POST", path)
    connection.putheader("Content-Type", "application/json")
    connection.putheader("Content-Length", str(length))
    connection.endheaders()
    status = connection.getresponse().status
    connection.close()
    return status, round(time.perf_counter() - start, 3)


def _attack(port: int, idle: int, slow: int, nice: int, cpus: set[int] | None, pipe) -> None:
    """Hold `idle` connections that send nothing and `slow` ones that send a request's head a
    byte a second, reopening each the server closes (once a second), until told to stop; say
    how many connects failed. `nice`: this process's CPU priority (0 as the server's, 19 the
    least); `cpus`: the only CPUs it runs on (None: any), as an attacker on a machine of its own
    would take none of the server's."""
    os.nice(nice)
    if cpus:
        os.sched_setaffinity(0, cpus)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: " + b"x" * 10_000
    selector, failed, sent = selectors.DefaultSelector(), 0, {}

    def connect(kind: str) -> None:
        nonlocal failed
        try:
            connection = socket.create_connection(("127.0.0.1", port), timeout=5)
        except OSError:
            failed += 1
            return
        connection.setblocking(False)
        selector.register(connection, selectors.EVENT_READ, kind)
        if kind == "slow":
            sent[connection] = 0

    missing = {"idle": idle, "slow": slow}
    pipe.send("ready")
    while not pipe.poll(1.0):
        for kind, count in missing.items():
            for _ in range(count):
                connect(kind)
        missing = {"idle": 0, "slow": 0}
        for connection in list(sent):  # a byte of its head each
            try:
                connection.send(head[sent[connection]:sent[connection] + 1])
                sent[connection] += 1
            except OSError:
                pass  # closed: the selector sees it
        for key, _ in selector.select(timeout=0):
            selector.unregister(key.fileobj)
            sent.pop(key.fileobj, None)
            key.fileobj.close()
            missing[key.data] += 1
    pipe.send({"failed_connects": failed})


def _under_attack(port: int, idle: int, slow: int, nice: int, cpus: set[int] | None, measure) -> dict:
    """`measure()` from the moment `idle` and `slow` clients start opening connections to the
    server (two processes: one process may not hold 20,000 descriptors), and how many connects
    failed."""
    spawn = multiprocessing.get_context("spawn")
    pipes, processes = [], []
    for share_idle, share_slow in ((idle - idle // 2, slow), (idle // 2, 0)):
        ours, theirs = spawn.Pipe()
        args = (port, share_idle, share_slow, nice, cpus, theirs)
        processes.append(spawn.Process(target=_attack, args=args, daemon=True))
        processes[-1].start()
        pipes.append(ours)
    for pipe in pipes:
        assert pipe.recv() == "ready"
    try:
        result = measure()
    finally:
        for pipe in pipes:
            pipe.send("stop")
        held = [pipe.recv() for pipe in pipes]
        for process in processes:
            process.join(timeout=30)
    return {**result, "attack_failed_connects": sum(h["failed_connects"] for h in held)}


def bench_hostile(classes: int = 300, idle: int = 20_000, slow: int = 50, held_s: float = 80.0,
                  policy: str = "ucb", attacker_nice: int = 0, attacker_cpus: set[int] | None = None,
                  server_code: str | None = None) -> dict:
    """`policy`: the server's (`off` skips the calibration a learning policy runs on a new store,
    a minute here); `attacker_cpus`: the attacking processes run on these CPUs only and the
    server on the others (on one machine, as attackers on machines of their own); `server_code`:
    a checkout (e.g. a git worktree of an older commit) whose code the server runs, the bench's
    own code driving it."""
    server_cpus = None
    if attacker_cpus:
        server_cpus = os.sched_getaffinity(0) - set(attacker_cpus)
        if not server_cpus or not set(attacker_cpus) <= os.sched_getaffinity(0):
            raise ValueError(f"attacker CPUs {sorted(attacker_cpus)} must be some, not all, of this process's CPUs"
                             f" {sorted(os.sched_getaffinity(0))}: the server runs on the others")
    env = os.environ | ({"PYTHONPATH": os.path.abspath(server_code)} if server_code else {})
    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, "-m", "autotune.cli", "serve", "--port", "0", "--policy", policy,
                   "--db", f"sqlite:///{tmp}/hostile.db"]
        server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
                                  cwd=tmp,  # not this folder's code first on the path
                                  # a session of its own, as a service manager or a shell starts a
                                  # server: where the kernel groups a session's threads
                                  # (autogroup), the server's then share the CPU with the
                                  # attackers' processes as one group, and its threads' nice
                                  # values rank them against each other, not against the attackers
                                  start_new_session=True,
                                  preexec_fn=(lambda: os.sched_setaffinity(0, server_cpus)) if server_cpus else None)
        try:
            watched = psutil.Process(server.pid)
            base = server.stdout.readline().split(" at ")[1].split("/v1")[0]
            normal = {"prompt": "def add(a, b):\n    return", "max_tokens": 8, "temperature": 0,
                      "request_class": "code"}
            first = [_call(base + "/v1/completions", normal)[1] for _ in range(5)]
            result = {"normal_request_s_median": statistics.median(first), "rss_mb_start": _rss_mb(watched),
                      "server_cpus": sorted(os.sched_getaffinity(server.pid)),
                      "server_own_session": os.getsid(server.pid) != os.getsid(0),
                      "sched_autogroup": _autogroup_enabled()}
            # Over the body limit (8 MiB by default), refused before they are read; under it, a
            # prompt's length in characters is checked before it is tokenized.
            for name, path, body in [("prompt_30MB", "/v1/completions", {"prompt": "x = 1; " * 4_285_714,
                                                                         "max_tokens": 4}),
                                     ("tokenize_10MB", "/tokenize", {"prompt": "x = 1; " * 1_428_571}),
                                     ("prompt_6MB", "/v1/completions", {"prompt": "x = 1; " * 857_142,
                                                                        "max_tokens": 4})]:
                status, seconds, _ = _call(base + path, body)
                result[name] = {"status": status, "seconds": seconds, "rss_mb_after": _rss_mb(watched)}
                if status == 0:  # closed while the body was sent: what the server answered from its head
                    status, seconds = _head_answer(base, path, len(json.dumps(body)))
                    result[name] |= {"answer_to_the_head": status, "answer_to_the_head_s": seconds}

            def tenant(i: int) -> int:
                return _call(base + "/v1/completions", {**normal, "max_tokens": 4, "request_class": f"tenant-{i}"})[0]

            started = time.perf_counter()  # one after another: a key each (together they would share a batch's)
            statuses = [tenant(i) for i in range(classes)]
            result["classes"] = {"count": classes, "ok": statuses.count(200),
                                 "seconds": round(time.perf_counter() - started, 1)}
            for name, path in (("metrics", "/metrics"), ("policy", "/v1/autotune/policy")):
                status, seconds, size = _call(base + path)
                result[name] = {"status": status, "seconds": seconds, "bytes": size}
            result["normal_request_s_after"] = statistics.median(
                [_call(base + "/v1/completions", normal)[1] for _ in range(5)])
            result["rss_mb_end"] = _rss_mb(watched)
            port = int(base.rsplit(":", 1)[1])
            quiet = [_call(base + "/v1/completions", normal)[1] for _ in range(10)]
            quiet_kept_alive = _kept_alive(base, normal, 10)

            def normal_requests_then_stop() -> dict:
                started, series, series_ok = time.perf_counter(), [], 0
                while (at := time.perf_counter() - started) < held_s:
                    status, seconds, _ = _call(base + "/v1/completions", normal, timeout=30)
                    series.append((round(at, 1), seconds))
                    series_ok += status == 200
                    time.sleep(max(0.0, at + 1 - (time.perf_counter() - started)))
                timed = [_call(base + "/v1/completions", normal, timeout=30) for _ in range(10)]
                kept_alive = _kept_alive(base, normal, 10)
                rss, held = _rss_mb(watched), watched.num_fds()
                server.send_signal(signal.SIGTERM)
                stopped = time.perf_counter()
                try:
                    server.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    server.kill()
                quiet_s = statistics.median(quiet)
                within_2x = [seconds <= 2 * quiet_s for _, seconds in series]
                slowest_at, slowest = max(series, key=lambda point: point[1])
                return {"normal_request_s_quiet": quiet_s,
                        "held_s": held_s, "series_s": series,  # (seconds since the attack began, seconds)
                        "series_ok": series_ok, "series_within_2x_quiet": round(sum(within_2x) / len(series), 3),
                        "series_slowest_s": slowest, "series_slowest_at_s": slowest_at,
                        "normal_request_s": statistics.median(t[1] for t in timed),
                        "normal_request_s_each": [t[1] for t in timed],
                        "normal_request_s_max": max(t[1] for t in timed),
                        "normal_ok": sum(t[0] == 200 for t in timed),
                        # a connection per request must get through the attackers' connects
                        # (dropped when the listen queue is full: the client's SYN then waits its
                        # 1 s retransmission); a kept-alive one has no connect to make
                        "kept_alive_s_quiet": round(statistics.median(quiet_kept_alive), 4),
                        "kept_alive_s": round(statistics.median(kept_alive), 4), "kept_alive_s_each": kept_alive,
                        "rss_mb": rss, "server_descriptors_open": held,
                        "sigterm_to_exit_s": round(time.perf_counter() - stopped, 2), "exit_code": server.returncode}

            attacked = _under_attack(port, idle, slow, attacker_nice, attacker_cpus, normal_requests_then_stop)
            result["attack"] = {"idle": idle, "slow": slow, "attacker_nice": attacker_nice,
                                "attacker_cpus": sorted(attacker_cpus) if attacker_cpus else None, **attacked}
            result["attack"]["latency_vs_quiet"] = round(result["attack"]["normal_request_s"]
                                                         / result["attack"]["normal_request_s_quiet"], 2)
        finally:
            if server.poll() is None:
                server.send_signal(signal.SIGTERM)
                try:
                    server.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    server.kill()
    return result
