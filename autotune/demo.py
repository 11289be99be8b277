"""The main job on built-in defaults: a mixed workload through the controller."""

from __future__ import annotations

from collections import Counter, defaultdict

from tqdm import tqdm

from autotune.control.controller import AutotuneController
from autotune.control.inspect_store import format_table
from autotune.data.classes import Workload, builtin_classes
from autotune.train.zoo import load_engine
from store import Store

DEMO_WEIGHTS = {"code": 0.3, "docs": 0.2, "edit": 0.3, "creative": 0.2}


def run_demo(url: str | None, family=None, device: str = "cpu", requests: int = 120, policy: str = "ucb",
             seed: int = 0, progress=print, bar: bool = True) -> dict:
    """Serve the demo workload through a controller; `bar`: a progress bar with the time left
    (tqdm, on stderr)."""
    engine = load_engine(family, device=device)
    classes = builtin_classes(include_shared=False)
    stream = Workload(DEMO_WEIGHTS, n_requests=requests, seed=seed).requests(classes)
    log = defaultdict(list)
    with Store(url, label="demo") as store:
        progress(f"store: {store.url}")
        progress(f"engine: {engine.identity}  device: {engine.device}")
        progress(f"serving {requests} requests from {sorted(DEMO_WEIGHTS)} with policy '{policy}'")
        with AutotuneController(engine, store, policy=policy) as controller:
            for req in tqdm(stream, desc="serving", unit="req", disable=not bar, dynamic_ncols=True):
                r = controller.generate(req.prompt, req.request_class, req.max_new_tokens, req.temperature,
                                        req.top_p, req.seed)
                log[req.request_class].append(r)
        rows = []
        for name, results in sorted(log.items()):
            recent = results[len(results) // 2:]  # after most of the exploration
            arm, _ = Counter(str(r.arm) for r in recent).most_common(1)[0]
            chosen = [r for r in recent if str(r.arm) == arm]
            acc = [r.metrics.acceptance for r in chosen if r.metrics.acceptance is not None]
            rows.append({
                "class": name,
                "requests": len(results),
                "arm_now": arm,
                "share_recent": f"{len(chosen) / len(recent):.0%}",
                "acceptance": round(sum(acc) / len(acc), 3) if acc else None,
                "speedup_vs_off": round(sum(r.reward for r in chosen) / len(chosen), 2),
                "tokens_per_s": round(sum(r.goodput for r in chosen) / len(chosen), 1),
            })
        progress("\n" + format_table(rows))
        progress(f"\nlearned state and {store.count()} observations are in {store.url}")
        progress("inspect it with: autotune inspect --db " + store.url)
    return {"store": store.url, "classes": rows}
