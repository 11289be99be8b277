"""`autotune bench durability`: what controllers learn survives kill -9 and adds up across replicas.

- kills: `lives` controller processes one after another on one store, each serving the demo's
  workload (save_every=5) and killed with SIGKILL at a random point, each resuming the last.
  Then a fresh controller resumes: its policy should count every update journaled, and the
  journal should hold an update for every observation that survived.
- replicas: `replicas` controller processes at once on a fresh store, `requests` each; a resume
  should count all of them, and the last replica to finish should already have folded them all.
- locked: requests (code, 32 tokens, save_every=1) while another process holds the store's write
  lock for 20 s (SQLite: BEGIN IMMEDIATE; PostgreSQL: the store's tables locked ACCESS
  EXCLUSIVE), against the same requests unlocked.
Every process is a real controller over the committed family, one request at a time.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from autotune.control.learning import SharedLearning
from store import Store

ROOT = Path(__file__).resolve().parents[2]

CONTROLLER = """
import sys
from autotune.data.classes import Workload, builtin_classes
from autotune.control.controller import AutotuneController
from autotune.demo import DEMO_WEIGHTS
from autotune.train.zoo import load_engine
from store import Store

url, requests, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
engine = load_engine()
stream = Workload(DEMO_WEIGHTS, n_requests=requests, seed=seed).requests(builtin_classes(include_shared=False))
with Store(url, label="durability") as store:
    controller = AutotuneController(engine, store, policy="ucb", save_every=5)
    print("ready", flush=True)
    for i, req in enumerate(stream):
        controller.generate(req.prompt, req.request_class, req.max_new_tokens, req.temperature, req.top_p, req.seed)
        print("served", i, flush=True)
    controller.close()
    print("pulls", sum(t.pulls for t in controller.policy.tables.values()), flush=True)
"""


def _start(url: str, requests: int, seed: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    return subprocess.Popen([sys.executable, "-c", CONTROLLER, url, str(requests), str(seed)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _resumed(url: str) -> dict:
    """What a fresh controller resumes: updates in its policy, journal rows, observations."""
    from autotune.control.controller import default_arms
    from autotune.train.zoo import load_engine
    from policies import make_policy

    with Store(url) as store:
        policy = make_policy("ucb", default_arms(load_engine()))
        SharedLearning(store, policy).resume()
        return {"resumed_updates": sum(t.pulls for t in policy.tables.values()),
                "journaled": len(store.policy_updates("ucb")), "observations": store.count(),
                "integrity": store.integrity_check()}


def bench_kills(url: str, lives: int = 12, seed: int = 0) -> dict:
    rng = random.Random(seed)
    served = []
    for life in range(lives):
        child = _start(url, 10_000, life)
        stop_after = rng.randint(3, 40)  # requests served in this life before the kill comes due
        count = 0
        for line in child.stdout:
            if line.startswith("served"):
                count += 1
                if count >= stop_after:
                    break
        time.sleep(rng.uniform(0.0, 0.3))  # a random point: mid-request, mid-save, mid-write
        child.send_signal(signal.SIGKILL)
        child.wait()
        served.append(count)
    result = _resumed(url)
    return {"lives": lives, "served_seen_per_life": served, **result,
            # a request the client saw served whose observation did not survive the kill
            "served_not_in_store": max(0, sum(served) - result["observations"]),
            "updates_lost_vs_observations": max(0, result["observations"] - result["resumed_updates"]),
            "updates_lost_vs_journal": result["journaled"] - result["resumed_updates"]}


def bench_replicas(url: str, replicas: int = 4, requests: int = 30) -> dict:
    started = time.perf_counter()
    children = [_start(url, requests, n) for n in range(replicas)]
    final = []
    for child in children:
        out, err = child.communicate(timeout=1800)
        if child.returncode != 0:
            raise RuntimeError(f"a replica failed: {err[-2000:]}")
        final.append(int(out.split()[-1]))
    return {"replicas": replicas, "requests_each": requests, "wall_s": round(time.perf_counter() - started, 1),
            "each_replica_at_its_end": final, **_resumed(url), "expected": replicas * requests}


HOLD_SQLITE = """
import sqlite3, sys, time
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("BEGIN IMMEDIATE")
print("locked", flush=True)
time.sleep(float(sys.argv[2]))
"""

HOLD_POSTGRES = """
import sys, time
from sqlalchemy import create_engine, text
with create_engine(sys.argv[1]).connect() as conn:
    conn.execute(text("LOCK TABLE autotune_observations, autotune_policy_updates, autotune_policy_states,"
                      " autotune_policy_checkpoints IN ACCESS EXCLUSIVE MODE"))
    print("locked", flush=True)
    time.sleep(float(sys.argv[2]))
"""


def bench_locked(url: str, seconds: float = 20.0, requests: int = 6) -> dict:
    from autotune.control.controller import AutotuneController
    from autotune.data.classes import builtin_classes
    from autotune.train.zoo import load_engine

    engine = load_engine()
    prompts = builtin_classes(include_shared=False)["code"].prompts[:requests]
    with Store(url) as store:
        controller = AutotuneController(engine, store, policy="ucb", save_every=1)
        for prompt in prompts[:3]:
            controller.generate(prompt, "code", max_new_tokens=32)

        def timed() -> list[float]:
            spent = []
            for prompt in prompts:
                start = time.perf_counter()
                controller.generate(prompt, "code", max_new_tokens=32)
                spent.append(round(time.perf_counter() - start, 3))
            return spent

        unlocked = timed()
        target = url.split(":///", 1)[1] if url.startswith("sqlite") else url
        holder = subprocess.Popen([sys.executable, "-c", HOLD_SQLITE if url.startswith("sqlite") else HOLD_POSTGRES,
                                   target, str(seconds)], stdout=subprocess.PIPE, text=True)
        holder.stdout.readline()
        locked = timed()
        holder.wait()
        closed = time.perf_counter()
        controller.close()
        close_s = time.perf_counter() - closed
        journaled = len(store.policy_updates("ucb"))
    return {"lock_s": seconds, "unlocked_request_s": unlocked, "locked_request_s": locked,
            "close_after_lock_s": round(close_s, 3), "journaled": journaled,
            "updates": sum(t.pulls for t in controller.policy.tables.values())}


def bench_durability(url_of, lives: int = 12, replicas: int = 4, requests: int = 30) -> dict:
    """Every part on fresh stores: `url_of(name)` gives a fresh store's URL."""
    return {"kills": bench_kills(url_of("kills"), lives),
            "replicas": bench_replicas(url_of("replicas"), replicas, requests),
            "locked": bench_locked(url_of("locked"), seconds=5.0 if lives < 12 else 20.0)}
