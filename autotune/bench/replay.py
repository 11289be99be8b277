"""`autotune bench replay`: how well one OFF request's counterfactual replay predicts the
reward every arm measures on the same prompts."""

from __future__ import annotations

import statistics
from collections import defaultdict

from autotune.bench.common import device_name, rotate
from autotune.data.classes import RequestClass
from autotune.rewards.costs import CostModel
from autotune.rewards.replay import arm_rewards, verify_owners
from engine import Arm, SamplingParams, SpeculativeEngine


def bench_replay(engine: SpeculativeEngine, classes: dict[str, RequestClass], arms: list[Arm],
                 prompts_per_class: int = 6, progress=print) -> dict:
    """How well replaying one request (autotune/rewards/replay.py) predicts every arm's reward.

    Every prompt is served on every arm, arms taking turns; each arm's measured reward is the
    controller's (the OFF time of this request's output over the time taken). The estimate is
    what the controller would have learned from the OFF request alone, at the costs measured
    over the whole class, so this measures the replay and the cost model, not the learning.
    """
    engine.warm_up(arms)
    out, errors = {}, []
    for name, cls in classes.items():
        costs = CostModel(prompts_per_class, verify_owners(engine))  # every request of the class
        off = [0.0, 0.0]  # OFF decode [steps, seconds]
        served = []
        for i, prompt in enumerate(cls.prompts[:prompts_per_class]):
            ids = engine.encode(prompt).tolist()
            sampling = SamplingParams(cls.temperature, cls.top_p, seed=i)
            results = {}
            for arm in rotate(arms, i):
                results[str(arm)] = r = engine.generate(ids, arm, cls.max_new_tokens, sampling)
                costs.observe(arm, r.metrics)
                if arm.is_off:
                    off[0] += r.metrics.rounds
                    off[1] += r.metrics.verify_s
            served.append((ids, sampling, results))
        step = off[1] / off[0]
        measured, estimated = defaultdict(list), defaultdict(list)
        for ids, sampling, results in served:
            for arm, r in results.items():
                m = r.metrics
                measured[arm].append((m.prefill_s - m.draft_prefill_s + (m.new_tokens - 1) * step) / m.total_s)
            r = results["off"]
            estimates = arm_rewards(engine, arms, costs, [(ids, r.tokens, cls.max_new_tokens)], r.metrics.prefill_s,
                                    step, sampling)
            for arm, value in estimates.items():
                estimated[arm].append(value)
        rows = {}
        for arm in measured:
            rows[arm] = {"measured": round(statistics.fmean(measured[arm]), 3),
                         "estimated": round(statistics.fmean(estimated[arm]), 3)}
            errors.append(abs(rows[arm]["estimated"] - rows[arm]["measured"]))
        out[name] = rows
        worst = max(rows, key=lambda a: abs(rows[a]["estimated"] - rows[a]["measured"]))
        progress(f"{name}: worst {worst} measured {rows[worst]['measured']} estimated {rows[worst]['estimated']}")
    return {"device": device_name(engine), "cache": engine.cache_kind, "prompts_per_class": prompts_per_class,
            "mean_abs_error": round(statistics.fmean(errors), 4), "max_abs_error": round(max(errors), 4),
            "classes": out}
