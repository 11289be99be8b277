"""What a policy has learned, per class, read back from the store (CLI `inspect`, notebooks)."""

from __future__ import annotations

import math
import time
from collections import defaultdict

from autotune.backends.controller import COSTS_POLICY as BACKEND_COSTS_POLICY
from autotune.control.controller import INTERNAL_POLICIES
from autotune.control.learning import learned_states


def best_arm(state: dict) -> tuple[str, float, float, float] | None:
    """(arm, mean reward, standard error, discounted count) of the best arm in a bandit state."""
    rows = {a: r for a, r in state.get("rows", {}).items() if r[0] > 1e-9}
    if not rows:
        return None
    arm = max(rows, key=lambda a: rows[a][1] / rows[a][0])
    n, s, ss = rows[arm]
    mean = s / n
    var = max(0.0, ss / n - mean * mean)
    return arm, mean, math.sqrt(var / n) if n > 1 else float("inf"), n


def latest_policy(store) -> str | None:
    internal = (*INTERNAL_POLICIES, BACKEND_COSTS_POLICY)  # the controllers' own state, not a policy's
    history = [h for h in store.policy_history() if h["policy"] not in internal]
    return history[-1]["policy"] if history else None


def policy_table(store, policy: str | None = None, offset: int = 0, limit: int | None = None) -> list[dict]:
    """A row per (class, load) the policy learned, in key order; `offset` and `limit` page
    through them (a server with thousands of tenants shows a page, and reads only its history)."""
    policy = policy or latest_policy(store)
    if policy is None:
        return []
    states = learned_states(store, policy)  # the checkpoint and the journal after it
    every = sorted(key for key in states if "@" in key)
    keys = every[offset:] if limit is None else every[offset:offset + limit]
    history = defaultdict(list)  # key -> its saved versions, oldest first
    for h in store.policy_history(policy, keys=None if keys == every else keys):
        history[h["request_class"]].append(h)
    stats = {(s.request_class, s.arm): s for s in store.arm_stats()}
    rows = []
    for key in keys:
        state = states[key]
        found = best_arm(state)
        if found is None:
            continue
        arm, mean, se, _ = found
        request_class, load = key.split("@", 1)
        last_change, previous = None, None
        for h in history[key]:
            chosen = best_arm(h["state"])
            if chosen and chosen[0] != previous:
                last_change, previous = h["saved_at"], chosen[0]
        observed = stats.get((request_class, arm))
        rows.append({
            "class": request_class,
            "load": load.removeprefix("load"),
            "arm": arm,
            "speedup_vs_off": round(mean, 3),
            "confidence_se": round(se, 3),
            "pulls": sum(state.get("counts", {}).values()),
            "arm_pulls": state.get("counts", {}).get(arm, 0),
            "mean_goodput": round(observed.goodput_mean, 2) if observed else None,
            "acceptance": round(observed.acceptance_mean, 3) if observed and observed.acceptance_mean else None,
            "guard_off": bool(state.get("guarded")),
            "last_change": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(last_change)) if last_change else "",
        })
    return rows


def format_table(rows: list[dict], columns: list[str] | None = None) -> str:
    if not rows:
        return "(no rows)"
    columns = columns or list(rows[0])
    cells = [[str(r.get(c, "")) if r.get(c) is not None else "-" for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)
