"""`autotune bench controller --many-classes`: many request classes with a few requests each,
counted from the first request, as a server with many tenants meets the controller.

Every request is served by every configuration in turn (the policies under test, each a
fresh controller with a store of its own, and static arms, OFF among them), so each ratio
compares the same requests. The best static arm and the per-class oracle are chosen in
hindsight among the static arms served; a ratio against them is the controller's goodput,
learning cost included (decisions, replays and saves are counted in its seconds), over
theirs. It also checks each reward the policy learned from against what physics allows (a
request cannot beat OFF by more than the tokens it committed per verify round), and how the
rewards recorded or replayed for each static arm compare with that arm's speedup measured on
the same requests (the calibration table, per arm kind and prompt length).
"""

from __future__ import annotations

import json
import random
import zlib
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import numpy as np
import scipy.stats

from autotune.bench.common import device_name, p99, rotate
from autotune.control.controller import AutotuneController, default_arms
from autotune.data.classes import Request, RequestClass
from autotune.train.tune import tune_by_replay
from engine import SpeculativeEngine
from engine.arms import OFF, Arm
from engine.drafters import capabilities, lookup_of, model_drafter_of
from policies import make_policy
from store import Store

STATIC_ARMS = ("off", "ngram:4", "ngram:6", "distilled:2", "distilled:4", "ngram+distilled:2", "ngram+distilled:4",
               "feature:4", "feature:8", "ngram+feature:4", "ngram+feature:8",
               "feature-prose:4", "feature-prose:6", "ngram+feature-prose:4", "ngram+feature-prose:6")


def tenant_classes(base: dict[str, RequestClass], count: int) -> dict[str, RequestClass]:
    """`count` classes: the `base` ones, then each sampled at 0.7 (a greedy class) or greedy (a
    sampled one), then each with outputs of 32 tokens, as tenants that share domains differ."""
    variants = [replace(c, name=f"{c.name}-t0.7", temperature=0.7, top_p=0.9) if c.temperature == 0 else
                replace(c, name=f"{c.name}-greedy", temperature=0.0, top_p=1.0) for c in base.values()]
    variants += [replace(c, name=f"{c.name}-short", max_new_tokens=32) for c in base.values()]
    classes = [*base.values(), *variants]
    if count > len(classes):
        raise ValueError(f"at most {len(classes)} classes can be made from {len(base)}, not {count}")
    return {c.name: c for c in classes[:count]}


def tenant_stream(classes: dict[str, RequestClass], per_class: int, seed: int = 0) -> list[Request]:
    """`per_class` requests of every class, other prompts each, in a shuffled order."""
    rng = random.Random(seed)
    requests = [Request(name, prompt, cls.temperature, cls.top_p, cls.max_new_tokens, rng.randrange(2**31))
                for name, cls in classes.items()
                for prompt in rng.sample(cls.prompts, min(per_class, len(cls.prompts)))]
    rng.shuffle(requests)
    return requests


def arm_kind(engine: SpeculativeEngine, arm: str) -> str:
    """What drafts on `arm`: "model", "feature", "layer skip", "n-gram", or n-gram lookup first
    and one of the others ("n-gram+model", ...); "off"."""
    drafter = engine.drafters.get(Arm.parse(arm).drafter)
    if drafter is None:
        return "off"
    declared = capabilities(drafter)
    inner = "feature" if declared.features else "layer skip" if declared.shares_target else \
        "model" if model_drafter_of(drafter) is not None else None
    if lookup_of(drafter) is None:
        return inner or "unknown"
    return "n-gram" if inner is None else f"n-gram+{inner}"


def _goodput(rows: list[dict]) -> float:
    seconds = sum(r["seconds"] for r in rows)
    return sum(r["tokens"] for r in rows) / seconds if seconds else 0.0


def bench_many_classes(engine: SpeculativeEngine, classes: dict[str, RequestClass], out_dir: Path,
                       per_class: int = 8, policies=("ucb", "contextual"), statics=STATIC_ARMS,
                       seed: int = 0, chosen: dict | None = None, warm_start: int | None = None, noise=None,
                       progress=print) -> dict:
    """`chosen`: the static best arm and oracle arms of another run (its JSON), measured here
    instead of picked in hindsight: on a noisy machine the best of seven arms over eight
    requests is partly the luckiest, which inflates the oracle a hindsight pick measures
    (1.12x the best static arm against 1.04x quiet). `noise`: injected delays
    (`autotune.bench.noise.InjectedDelays`), restarted before each configuration serves a
    request so that all of them meet the same bursts on it. `warm_start`: each policy also serves
    as "<policy>-warm", its store first tuned offline (`tune_by_replay`) on at most this many
    prompts a class that the stream does not serve."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    arms = default_arms(engine)
    statics = [s for s in statics if Arm.parse(s).is_off or Arm.parse(s).drafter in engine.drafters]
    stream = tenant_stream(classes, per_class, seed)
    controllers = {}
    for name in policies:
        controllers[name] = AutotuneController(engine, _fresh_store(out_dir, name), policy=make_policy(name, arms))
    if warm_start:
        served = {r.prompt for r in stream}
        sample = {c: replace(cls, prompts=tuple(p for p in cls.prompts if p not in served)[:warm_start])
                  for c, cls in classes.items()}
        sample = {c: cls for c, cls in sample.items() if cls.prompts}
        for name in policies:
            store = _fresh_store(out_dir, f"{name}-warm")
            progress(f"{name}-warm: tuning offline on {sum(len(c.prompts) for c in sample.values())} other prompts")
            tune_by_replay(engine, store, sample, name, warm_start)
            controllers[f"{name}-warm"] = AutotuneController(engine, store, policy=make_policy(name, arms))
        policies = [*policies, *(f"{name}-warm" for name in policies)]
    for arm in statics:
        controllers[arm] = AutotuneController(engine, policy="static", arms=[OFF, Arm.parse(arm)], arm=arm)
    progress(f"{len(classes)} classes x {per_class} requests, each served by {len(controllers)} configurations")
    log = {name: [] for name in controllers}
    for i, req in enumerate(stream):
        for name in rotate(list(controllers), i):
            if noise is not None:
                noise.restart(i)
            r = controllers[name].generate(req.prompt, req.request_class, req.max_new_tokens, req.temperature,
                                           req.top_p, req.seed)
            m = r.metrics
            own = m.without_probes()  # what the reward prices: the arm's rounds, not OFF's among them
            log[name].append({
                "class": req.request_class, "arm": str(r.arm), "tokens": m.new_tokens, "engine_s": m.total_s,
                "seconds": m.total_s + r.decision_s + r.learn_s, "overhead_s": r.decision_s + r.learn_s,
                "reward": r.reward, "bound": max(1.0, (own.new_tokens - 1) / own.rounds) if own.rounds else 1.0,
                "estimates": r.estimates, "prompt_tokens": m.prompt_tokens,
                "greedy": req.temperature == 0, "output": zlib.crc32(repr(r.tokens).encode())})
        if (i + 1) % 20 == 0:
            progress(f"  {i + 1}/{len(stream)} requests")
    for ctl in controllers.values():
        ctl.close()
        if ctl.store is not None:
            ctl.store.close()
    (out_dir / "tenants-log.json").write_text(json.dumps(log))  # every configuration's row per request
    return summarize(engine, log, list(policies), statics, classes, per_class, chosen)


def _fresh_store(out_dir: Path, name: str) -> Store:
    path = out_dir / f"tenants-{name}.db"
    for stale in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        stale.unlink(missing_ok=True)  # a previous run's store would resume what it learned
    return Store(f"sqlite:///{path}", label=f"tenants {name}")


def summarize(engine: SpeculativeEngine, log: dict[str, list[dict]], policies: list[str], statics: list[str],
              classes: dict, per_class: int, chosen: dict | None = None) -> dict:
    names = list(classes)
    by_class = {name: {c: [r for r in rows if r["class"] == c] for c in names} for name, rows in log.items()}
    if chosen is not None:
        static_best, oracle_arms = chosen["static_best_arm"], chosen["oracle_arms"]
    else:
        static_best = max(statics, key=lambda s: _goodput(log[s]))
        oracle_arms = {c: max(statics, key=lambda s: _goodput(by_class[s][c])) for c in names}
    oracle_rows = [r for c in names for r in by_class[oracle_arms[c]][c]]
    oracle, best, off = _goodput(oracle_rows), _goodput(log[static_best]), _goodput(log["off"])
    result = {
        "device": device_name(engine),
        "classes": len(names),
        "requests_per_class": per_class,
        "counted_from": "the first request",
        "static_arms": statics,
        "static_best_arm": static_best,
        "arms_chosen": "in hindsight" if chosen is None else "by another run",
        "oracle_arms": oracle_arms,
        "oracle_vs_best_static": round(oracle / best, 3),
        "static_ratio_vs_off": {s: round(_goodput(log[s]) / off, 3) for s in statics},
        # greedy requests whose output differs between configurations (the target's own: none)
        "greedy_mismatches": sum(row.get("greedy", False) and len({log[name][i].get("output") for name in log}) > 1
                                 for i, row in enumerate(log["off"])),
        "policies": {},
    }
    for p in policies:
        rows = log[p]
        goodput = _goodput(rows)
        result["policies"][p] = {
            "ratio_vs_best_static": round(goodput / best, 3),
            "ratio_vs_best_static_interval_95": paired_interval(rows, log[static_best]),
            "ratio_vs_oracle": round(goodput / oracle, 3),
            "ratio_vs_off": round(goodput / off, 3),
            "worst_class_ratio_vs_off": round(min(_goodput(by_class[p][c]) / _goodput(by_class["off"][c])
                                                  for c in names), 3),
            "overhead_share": round(sum(r["overhead_s"] for r in rows) / sum(r["seconds"] for r in rows), 4),
            "decision_and_learning_ms_p99": p99(r["overhead_s"] * 1000 for r in rows),
            "rewards_above_bound": sum(r["reward"] > r["bound"] * (1 + 1e-9) for r in rows),
            "rewards": len(rows),
            "arms_played": dict(sorted(_count(r["arm"] for r in rows).items(), key=lambda kv: -kv[1])),
            "loss": where_the_loss_goes(log, p, by_class, oracle_arms),
            "reward_calibration": calibration(engine, log, p, statics),
        }
    return result


def paired_interval(rows: list[dict], other: list[dict]) -> list[float] | None:
    """The 95 % interval of `rows`' goodput over `other`'s on the same requests, bootstrapped over
    the requests (each resampled with its pair): how far the ratio can be trusted when requests
    move more than the configurations differ."""
    if len(rows) < 2:
        return None
    columns = [np.array([r[field] for r in side], dtype=float) for side in (rows, other)
               for field in ("tokens", "seconds")]

    def ratio(tokens, seconds, other_tokens, other_seconds, axis=-1):
        return (tokens.sum(axis) / seconds.sum(axis)) / (other_tokens.sum(axis) / other_seconds.sum(axis))

    interval = scipy.stats.bootstrap(columns, ratio, paired=True, vectorized=True, method="percentile",
                                     random_state=0).confidence_interval
    return [round(float(interval.low), 3), round(float(interval.high), 3)]


def where_the_loss_goes(log: dict[str, list[dict]], policy: str, by_class: dict, oracle_arms: dict) -> dict:
    """The policy's seconds beyond the per-class oracle's on the same requests, as shares of the
    policy's seconds: `overhead` (deciding, replays, the update, saves), `exploration` (requests
    served on an arm other than the one the class kept at its end, against the oracle's arm on
    the same request), `convergence` (requests served on the arm kept, against the oracle's arm:
    the cost of keeping the wrong one). Per class: the arm kept, the oracle's, and the class's
    ratio to the oracle. Timing noise lands in the last two (`paired_interval` bounds it)."""
    total = sum(r["seconds"] for r in log[policy])
    oracle_seconds = sum(r["seconds"] for c in by_class[policy] for r in by_class[oracle_arms[c]][c])
    shares = {"overhead": 0.0, "exploration": 0.0, "convergence": 0.0}
    per_class = {}
    for name, rows in by_class[policy].items():
        kept = rows[-1]["arm"]
        oracle_rows = by_class[oracle_arms[name]][name]
        for row, best in zip(rows, oracle_rows, strict=True):
            shares["overhead"] += row["overhead_s"]
            shares["exploration" if row["arm"] != kept else "convergence"] += row["engine_s"] - best["engine_s"]
        per_class[name] = {"kept": kept, "oracle": oracle_arms[name],
                           "explored": sum(r["arm"] != kept for r in rows), "requests": len(rows),
                           "ratio_vs_oracle": round(_goodput(rows) / _goodput(oracle_rows), 3)}
    settled = [r for rows in by_class[policy].values() for r in rows[10:]]  # once a class served 10
    return {**{k: round(v / total, 4) for k, v in shares.items()},
            "overhead_after_10_requests": round(sum(r["overhead_s"] for r in settled)
                                                / sum(r["seconds"] for r in settled), 4) if settled else None,
            "gap_to_oracle": round(1 - oracle_seconds / total, 4),
            "per_class": per_class}


def _count(items) -> dict[str, int]:
    counts: dict[str, int] = defaultdict(int)
    for item in items:
        counts[item] += 1
    return dict(counts)


def calibration(engine: SpeculativeEngine, log: dict[str, list[dict]], policy: str, statics: list[str]) -> dict:
    """Per arm kind, and per kind by prompt length (the shorter and longer half of the prompts)
    and by source (recorded playing the arm, or replayed): the mean reward `policy` learned for
    each static arm,
    over that arm's mean speedup measured on the same requests (its engine seconds against
    OFF's, tokens per second); 1.0 is true to scale. With the number of requests behind it."""
    lengths = sorted(r["prompt_tokens"] for r in log["off"])
    middle = lengths[len(lengths) // 2]
    cells = defaultdict(lambda: [0.0, 0.0, 0])
    for i, row in enumerate(log[policy]):
        off = log["off"][i]
        for arm in statics:
            if arm == "off":
                continue
            played = row["arm"] == arm
            told = row["reward"] if played else row["estimates"].get(arm)
            measured = log[arm][i]
            if told is None or not measured["engine_s"] or not off["tokens"]:
                continue
            speedup = (measured["tokens"] / measured["engine_s"]) / (off["tokens"] / off["engine_s"])
            kind = arm_kind(engine, arm)
            length = "short prompts" if row["prompt_tokens"] < middle else "long prompts"
            for key in (kind, f"{kind}, {length}", f"{kind}, {'recorded' if played else 'replayed'}"):
                cell = cells[key]
                cell[0] += told
                cell[1] += speedup
                cell[2] += 1
    return {key: {"told_over_measured": round(told / measured, 3), "requests": n}
            for key, (told, measured, n) in sorted(cells.items()) if measured > 0}
