"""`autotune bench arms`: every class on every arm, side by side, alone or in batches: the
ground truth the controller has to learn without."""

from __future__ import annotations

from collections import defaultdict

from autotune.bench.common import compile_total, device_name, rotate
from autotune.bench.controller import hindsight_arms
from autotune.data.classes import RequestClass, Workload
from engine import Arm, SamplingParams, SpeculativeEngine

BENCH_KS = (1, 2, 3, 4, 6, 8)


def loops(tokens: list[int], min_len: int = 24) -> bool:
    """The output ends in a short cycle (a weak model's 'import sys' repeated)."""
    for period in range(1, 17):
        span = max(min_len, 3 * period)
        if len(tokens) >= span and all(tokens[-i] == tokens[-i - period] for i in range(1, span - period + 1)):
            return True
    return False


def bench_arms(engine: SpeculativeEngine, classes: dict[str, RequestClass], arms: list[Arm],
               prompts_per_class: int = 6, max_new_tokens: int | None = None, batch: int = 1,
               coupled: bool = False, progress=print) -> dict:
    """Every class on every arm, side by side; the ground truth the controller must learn.

    batch > 1 measures the load case: `prompts_per_class // 3` (at least 2) batches of a class's
    next `batch` prompts, each served together on every arm, arms taking turns. Sampled requests
    are seeded, to be the same on every run, and sampled by the standard rejection rule, as an
    unseeded request is, or with `coupled` by the drafter-invariant rule (engine/coupled.py).
    """
    out = {}
    compile_report = engine.warm_up(arms) if batch == 1 else {}
    warm = engine.encode(next(iter(classes.values())).prompts[0]).tolist()
    for arm in arms:
        engine.generate(warm, arm, 4)
    for name, cls in classes.items():
        stats = {str(a): defaultdict(float) for a in arms}
        positions = {str(a): {"drafted": [0] * a.k, "accepted": [0] * a.k} for a in arms}  # per draft position
        loop_count = 0
        limit = max_new_tokens or cls.max_new_tokens
        if batch == 1:
            prompts = cls.prompts[:prompts_per_class]
            units = [[engine.encode(p).tolist()] for p in prompts]
        else:  # different batches: one batch's prompts are not the class
            prompts = cls.prompts[:batch * max(2, prompts_per_class // 3)]
            units = [[engine.encode(p).tolist() for p in prompts[i:i + batch]] for i in range(0, len(prompts), batch)]
        for i, unit in enumerate(units):
            for arm in rotate(arms, i):
                sampling = [SamplingParams(cls.temperature, cls.top_p, seed=i * batch + j, coupled=coupled)
                            for j in range(len(unit))]
                if batch == 1:
                    r = engine.generate(unit[0], arm, limit, sampling[0])
                    rows, m = [r], r.metrics
                else:
                    out_batch = engine.generate_batch(unit, arm, limit, sampling)
                    rows, m = out_batch.results, out_batch.metrics
                s = stats[str(arm)]
                s["tokens"] += m.new_tokens
                s["seconds"] += m.total_s
                s["drafted"] += m.drafted
                s["accepted"] += m.accepted
                s["rounds"] += sum(r.metrics.rounds for r in rows)
                s["requests"] += len(rows)
                for r in rows:
                    for what in ("drafted", "accepted"):
                        counts = getattr(r.metrics, f"{what}_per_position")
                        for j, n in enumerate(counts[:arm.k]):
                            positions[str(arm)][what][j] += n
                if arm.is_off:
                    loop_count += sum(loops(r.tokens) for r in rows)
        off_tps = stats["off"]["tokens"] / stats["off"]["seconds"]
        arms_out = {}
        for arm, s in stats.items():
            tps = s["tokens"] / s["seconds"]
            arms_out[arm] = {
                "acceptance": round(s["accepted"] / s["drafted"], 4) if s["drafted"] else None,
                # position j: the share of rounds that drafted a j-th token whose first j drafts were all kept
                "acceptance_per_position": [round(a / d, 4) if d else None for a, d in
                                            zip(positions[arm]["accepted"], positions[arm]["drafted"])],
                "mean_accepted": round((s["tokens"] - s["requests"]) / s["rounds"], 3) if s["rounds"] else None,
                "tokens_per_s": round(tps, 2),
                "speedup_vs_off": round(tps / off_tps, 3),
            }
        best = max(arms_out, key=lambda a: arms_out[a]["tokens_per_s"])
        out[name] = {"best_arm": best, "loop_rate": round(loop_count / len(prompts), 3), "arms": arms_out}
        speedup = arms_out[best]["speedup_vs_off"]
        progress(f"{name}: best {best} ({speedup}x vs off), loop rate {loop_count}/{len(prompts)}")
    result = {"device": device_name(engine), "cache": engine.cache_kind, "prompts_per_class": prompts_per_class,
              "batch": batch, "coupled": coupled, "compile_s_total": compile_total(compile_report), "classes": out}
    # What choosing per class could gain at all: the per-class oracle against the best single arm,
    # each class weighed by its OFF time (a stream with as many requests of each).
    _, static, gain = hindsight_arms({1: result}, Workload(dict.fromkeys(classes, 1.0)))  # one load: this one
    result |= {"best_static_arm": str(static), "oracle_vs_best_static": gain,
               "distinct_best_arms": len({c["best_arm"] for c in out.values()})}
    progress(f"per-class oracle {gain}x the best single arm {static};"
             f" {result['distinct_best_arms']} distinct best arms")
    return result
