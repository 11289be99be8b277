"""`autotune bench hostile`: `autotune serve` under requests meant to hurt it.

A server process over the committed family (from the code at $PYTHONPATH, so an older checkout
can be measured the same way), then: a 30 MB prompt, a 10 MB /tokenize, and `classes` distinct
request classes, each request timed with the server's resident memory before and after, and the
size and time of /metrics and /v1/autotune/policy once the classes are in.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def _call(url: str, body: dict | None = None) -> tuple[int, float, int]:
    """(status, seconds, bytes of the answer) of a GET, or a POST of `body`."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            status, size = response.status, len(response.read())
    except urllib.error.HTTPError as exc:
        status, size = exc.code, len(exc.read())
    return status, round(time.perf_counter() - start, 3), size


def bench_hostile(classes: int = 300) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        server = subprocess.Popen([sys.executable, "-m", "autotune.cli", "serve", "--port", "0", "--db",
                                   f"sqlite:///{tmp}/hostile.db"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                  text=True, env=os.environ.copy())
        try:
            base = server.stdout.readline().split(" at ")[1].split("/v1")[0]
            normal = {"prompt": "def add(a, b):\n    return", "max_tokens": 8, "temperature": 0,
                      "request_class": "code"}
            idle = [_call(base + "/v1/completions", normal)[1] for _ in range(5)]
            result = {"normal_request_s_median": statistics.median(idle), "rss_mb_start": round(_rss_mb(server.pid))}
            # Under the 32 MiB body limit, which is checked before a body is read.
            for name, path, body in [("prompt_30MB", "/v1/completions", {"prompt": "x = 1; " * 4_285_714,
                                                                         "max_tokens": 4}),
                                     ("tokenize_10MB", "/tokenize", {"prompt": "x = 1; " * 1_428_571})]:
                status, seconds, _ = _call(base + path, body)
                result[name] = {"status": status, "seconds": seconds, "rss_mb_after": round(_rss_mb(server.pid))}

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
            result["rss_mb_end"] = round(_rss_mb(server.pid))
        finally:
            server.send_signal(signal.SIGTERM)
            stopped = time.perf_counter()
            try:
                server.wait(timeout=120)
            except subprocess.TimeoutExpired:
                server.kill()
        result["sigterm_to_exit_s"] = round(time.perf_counter() - stopped, 2)
    return result
