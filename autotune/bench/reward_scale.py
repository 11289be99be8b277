"""`autotune bench rewards`: how true to scale the rewards a controller learns from are.

Each prompt is served OFF, on the arm, and on the arm with OFF rounds among its own
(`probe_off`), one right after another, the order alternating from prompt to prompt, so the
speedup measured (OFF's engine seconds per output token over the arm's) and the rewards price
the same work at nearly the same moment. The arm's request is priced twice, as the controller
prices it (`RewardModel.request_reward`): by the costs calibration measured before the first
request alone, and by those costs once every request's OFF rounds were learned from (what a
serving controller's costs become). Per arm and per arm kind (and per kind on short and long
prompts, LONG_PROMPT): each mean reward over the mean speedup measured (1.0 is true to scale),
and what the OFF rounds cost the requests that ran them.

Where the arms hold a drafter at several Ks, each of its requests also estimates the others
(`sibling_rewards`, what a controller learns of the Ks it did not play) from its speedup measured:
the mean estimate of an arm over its mean speedup measured isolates those estimates' error.
"""

from __future__ import annotations

import copy
import functools
import statistics
import threading
from collections import defaultdict

from autotune.bench.common import device_name, rotate
from autotune.bench.tenants import arm_kind
from autotune.control.controller import DEFAULT_KS
from autotune.data.classes import RequestClass
from autotune.rewards.replay import draft_cost_owner
from autotune.rewards.reward import PROBE_ROUNDS, RewardModel, calibrate
from autotune.rewards.siblings import sibling_rewards
from engine import Arm, RoundControl, SamplingParams, SpeculativeEngine

DEFAULT_ARMS = ("ngram:4", "distilled:4", "feature:4", "feature:8", "ngram+feature:4", "ngram+feature:8")
LONG_PROMPT = 256  # tokens from which a prompt counts as long in the per-kind rows (qa and summarize's, mostly)
# as the controller's calibration samples: by the standard rule
CALIBRATION_SAMPLING = {False: SamplingParams(), True: SamplingParams(0.7, 0.9, seed=0, coupled=False)}


def bench_reward_scale(engine: SpeculativeEngine, classes: dict[str, RequestClass], arms: list[Arm],
                       prompts_per_class: int = 6, progress=print) -> dict:
    engine.warm_up(arms)
    ks = {arm.drafter: list(DEFAULT_KS) for arm in arms}  # what a controller on default arms calibrates
    calibrated = {sampled: calibrate(engine, ks, sampling, threading.Lock())
                  for sampled, sampling in CALIBRATION_SAMPLING.items()}
    learned = copy.deepcopy(calibrated)
    served = []
    for name, cls in classes.items():
        for i, prompt in enumerate(cls.prompts[:prompts_per_class]):
            ids = engine.encode(prompt).tolist()
            sampling = SamplingParams(cls.temperature, cls.top_p, seed=i)
            for arm in rotate(arms, i):
                runs = {}
                for how in ("off", "arm", "probed") if i % 2 == 0 else ("probed", "arm", "off"):
                    probes = RoundControl(probe_off=PROBE_ROUNDS if how == "probed" else 0)
                    runs[how] = engine.generate(ids, "off" if how == "off" else arm, cls.max_new_tokens, sampling,
                                                control=probes).metrics
                learned[not sampling.greedy].observe(arm, runs["probed"])
                served.append((arm, not sampling.greedy, runs, (name, i), len(ids) >= LONG_PROMPT))
        progress(f"{name}: {prompts_per_class} prompts x {len(arms)} arms")
    measured = {}  # (prompt, arm) -> speedup measured
    for arm, _, runs, prompt, _ in served:
        off, m = runs["off"], runs["arm"]
        if off.new_tokens and m.new_tokens and off.total_s and m.total_s:
            measured[prompt, arm] = off.total_s / off.new_tokens / (m.total_s / m.new_tokens)
    cells = defaultdict(lambda: defaultdict(list))
    for arm, sampled, runs, prompt, long in served:
        m, probed = runs["arm"], runs["probed"]
        if (prompt, arm) not in measured:
            continue
        estimates = _sibling_estimates(engine, arm, m, measured, prompt, learned[sampled])
        kind = arm_kind(engine, str(arm))
        for key in (str(arm), kind, f"{kind}, {'long' if long else 'short'} prompts"):
            cell = cells[key]
            cell["measured"].append(measured[prompt, arm])
            for source, costs in (("calibration", calibrated), ("learned", learned)):
                cell[source].append(RewardModel.request_reward(arm, m, m.new_tokens - 1, costs[sampled]))
            cell["probe_cost"].append(probed.total_s / probed.new_tokens / (m.total_s / m.new_tokens) - 1)
        for other, estimate in estimates.items():
            for key in (f"{other} (estimated)", f"{arm_kind(engine, str(other))} (estimated)"):
                cells[key]["estimated"].append(estimate)
                cells[key]["measured"].append(measured[prompt, other])

    def row(cell: dict) -> dict:
        measured = statistics.fmean(cell["measured"])
        if "estimated" in cell:
            return {"estimated_over_measured": round(statistics.fmean(cell["estimated"]) / measured, 3),
                    "requests": len(cell["measured"])}
        return {"speedup_measured": round(measured, 3),
                "calibration_over_measured": round(statistics.fmean(cell["calibration"]) / measured, 3),
                "learned_over_measured": round(statistics.fmean(cell["learned"]) / measured, 3),
                "off_rounds_cost": round(statistics.fmean(cell["probe_cost"]), 3),
                "requests": len(cell["measured"])}

    names = {str(a) for a in arms}
    estimated = {key: row(cell) for key, cell in cells.items() if "estimated" in cell}
    return {"device": device_name(engine), "prompts_per_class": prompts_per_class, "classes": list(classes),
            "off_rounds_per_request": PROBE_ROUNDS,
            "arms": {key: row(cell) for key, cell in cells.items() if key in names},
            "kinds": {key: row(cell) for key, cell in cells.items() if key not in names and "estimated" not in cell},
            "siblings": {"arms": {k.removesuffix(" (estimated)"): v for k, v in estimated.items()
                                  if k.removesuffix(" (estimated)") in names},
                         "kinds": {k.removesuffix(" (estimated)"): v for k, v in estimated.items()
                                   if k.removesuffix(" (estimated)") not in names}}}


def _sibling_estimates(engine: SpeculativeEngine, arm: Arm, metrics, measured: dict, prompt, costs) -> dict[Arm, float]:
    """What the request on `arm` tells of its drafter's other Ks among the arms served on this
    prompt, scaled by its own speedup measured, as a controller's sibling estimates are by its reward."""
    others = [other for (p, other) in measured if p == prompt and other.drafter == arm.drafter and other != arm]
    if not others:
        return {}
    owner = draft_cost_owner(engine, arm.drafter)
    estimates = sibling_rewards(metrics, arm, measured[prompt, arm], [o.k for o in others],
                                functools.partial(costs.draft_cost, owner if owner in costs.draft else arm.drafter),
                                functools.partial(costs.verify_cost, drafter=arm.drafter))
    return {other: estimates[str(other)][0] for other in others if str(other) in estimates}
