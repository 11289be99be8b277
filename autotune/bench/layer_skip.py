"""`autotune bench layer-skip`: self-speculation with skip sets tuned per class, side by side.

Per class, a skip-set study (autotune/train/tune.py `tune_skip_sets`, SWIFT's search) runs on the
class's first prompts; then, on the class's next prompts, taking turns: OFF, the class's tuned
arm, every other class's tuned arm (the best of them over all classes is the best single skip
set), early exit after layer N as this engine runs it (the last layers skipped, drafting into the
target's cache), and transformers' own `assistant_early_exit=N` against transformers' plain
`generate()` on the same target, same prompts (its ratio is against its own OFF: the two engines'
speeds differ, the ratios compare). Each skip arm also gets its draft step's cost against a target
step: with acceptance, what decides whether it can pay.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from autotune.bench.common import device_name, rotate
from autotune.data.classes import RequestClass
from autotune.train.tune import priors_from_study, skippable_layers, tune_skip_sets
from engine import OFF, Arm, LayerSkipDrafter, SamplingParams, SpeculativeEngine
from engine.layer_skip import decoder_layers, skip_name


def early_exit_arm(engine: SpeculativeEngine, exit_after: int, k: int) -> Arm:
    """Early exit after `exit_after` layers: the later layers skipped (added to `engine` if new)."""
    _, _, layers = decoder_layers(engine.target)
    skip = set(range(exit_after, len(layers)))
    name = skip_name(skip)
    if name not in engine.drafters:
        engine.add_drafter(name, LayerSkipDrafter(skip))
    return Arm(name, k)


def hf_seconds(engine: SpeculativeEngine, ids: list[int], cls: RequestClass, max_new: int, seed: int,
               exit_after: int | None) -> tuple[float, int]:
    """transformers' `generate()` on the target (with `assistant_early_exit` when given): seconds, new tokens."""
    prompt = torch.tensor([ids], device=engine.device)
    options = {"do_sample": True, "temperature": cls.temperature, "top_p": cls.top_p} if cls.temperature else \
        {"do_sample": False}
    if exit_after is not None:
        options["assistant_early_exit"] = exit_after
    torch.manual_seed(seed)
    began = time.perf_counter()
    out = engine.target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_new,
                                 pad_token_id=min(engine.eos_token_id, default=None), **options)
    return time.perf_counter() - began, out.shape[1] - prompt.shape[1]


def step_cost_ratio(engine: SpeculativeEngine, drafter: str, prompt: list[int], repeats: int = 30) -> float:
    """Median seconds of the skip drafter's 1-token step over the median of the target's own, both
    fed at the same position of the same cache: what a draft costs against what it saves."""
    ids = torch.tensor(prompt, device=engine.device)
    view = engine.drafters[drafter].runner
    with torch.inference_mode():
        engine.runner.begin(ids[:-1], ids.numel() + 2)
        view.use_cache_of(engine.runner)
        last = ids[None, -1:].clone()
        times = {"target": [], "view": []}
        for _ in range(repeats):
            for name, runner in (("target", engine.runner), ("view", view)):
                began = time.perf_counter()
                runner.step(last, ids.numel() - 1, keep=1)
                times[name].append(time.perf_counter() - began)
                engine.runner.truncate(ids.numel() - 1)
    return statistics.median(times["view"]) / statistics.median(times["target"])


def bench_layer_skip(engine: SpeculativeEngine, classes: dict[str, RequestClass], tune_prompts: int = 3,
                     eval_prompts: int = 4, budget: int = 16, exits: tuple[int, ...] | None = None,
                     exit_k: int = 2, max_new_tokens: int | None = None, progress=print) -> dict:
    _, _, layers = decoder_layers(engine.target)
    exits = exits or tuple(range(max(1, len(layers) // 2), len(layers)))
    tuned: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as folder:
        url = f"sqlite:///{Path(folder) / 'skip.db'}"
        for name, cls in classes.items():
            study = tune_skip_sets(engine, cls, url, budget=budget, prompts_per_trial=tune_prompts, progress=False)
            priors = priors_from_study(study)
            best = max((a for a in priors if a != "off"), key=lambda a: priors[a][0])
            tuned[name] = {"arm": best, "tuning_speedup": round(priors[best][0], 3), "trials": len(study.trials)}
            progress(f"{name}: tuned {best} ({priors[best][0]:.2f}x OFF on its {tune_prompts} tuning prompts)")
    tuned_arms = sorted({Arm.parse(t["arm"]) for t in tuned.values()})
    exit_arms = [early_exit_arm(engine, n, exit_k) for n in exits]
    arms = [OFF, *tuned_arms, *[a for a in exit_arms if a not in tuned_arms]]
    hf_methods = [None, *exits]  # None: plain generate()
    engine.warm_up(arms)
    stats = {name: {str(a): defaultdict(float) for a in arms} for name in classes}
    hf = {name: {m: [0.0, 0] for m in hf_methods} for name in classes}
    for name, cls in classes.items():
        limit = max_new_tokens or cls.max_new_tokens
        prompts = cls.prompts[tune_prompts:tune_prompts + eval_prompts]
        for i, text in enumerate(prompts):
            ids = engine.encode(text).tolist()
            for arm in rotate(arms, i):
                r = engine.generate(ids, arm, limit, SamplingParams(cls.temperature, cls.top_p, seed=i))
                s = stats[name][str(arm)]
                for key, value in (("tokens", r.metrics.new_tokens), ("seconds", r.metrics.total_s),
                                   ("drafted", r.metrics.drafted), ("accepted", r.metrics.accepted)):
                    s[key] += value
            for method in rotate(hf_methods, i):
                seconds, tokens = hf_seconds(engine, ids, cls, limit, i, method)
                hf[name][method][0] += seconds
                hf[name][method][1] += tokens
    out = {}
    for name, cls in classes.items():
        rows = stats[name]
        off = rows["off"]["tokens"] / rows["off"]["seconds"]
        arms_out = {arm: {"speedup_vs_off": round(s["tokens"] / s["seconds"] / off, 3),
                          "acceptance": round(s["accepted"] / s["drafted"], 3) if s["drafted"] else None}
                    for arm, s in rows.items()}
        hf_off = hf[name][None][1] / hf[name][None][0]
        for arm, row in arms_out.items():
            if arm != "off":
                row["step_cost_vs_target"] = round(step_cost_ratio(engine, Arm.parse(arm).drafter,
                                                                   engine.encode(cls.prompts[0]).tolist()), 3)
        out[name] = {"tuned": tuned[name], "arms": arms_out,
                     "transformers_early_exit": {str(n): round(hf[name][n][1] / hf[name][n][0] / hf_off, 3)
                                                 for n in exits}}

    def mean_speedup(arm: Arm) -> float:
        return sum(out[c]["arms"][str(arm)]["speedup_vs_off"] for c in classes) / len(classes)

    best_single = max(tuned_arms, key=mean_speedup)
    best_exit = max(exit_arms, key=mean_speedup)
    for name in classes:
        arms_out = out[name]["arms"]
        out[name]["tuned_vs_best_single"] = round(arms_out[tuned[name]["arm"]]["speedup_vs_off"]
                                                  / arms_out[str(best_single)]["speedup_vs_off"], 3)
        out[name]["tuned_vs_early_exit"] = round(arms_out[tuned[name]["arm"]]["speedup_vs_off"]
                                                 / arms_out[str(best_exit)]["speedup_vs_off"], 3)
    return {"device": device_name(engine), "cache": engine.cache_kind, "skippable_layers": skippable_layers(engine),
            "tune_prompts": tune_prompts, "eval_prompts": eval_prompts, "budget": budget, "exit_k": exit_k,
            "best_single_skip_arm": str(best_single), "best_early_exit_arm": str(best_exit), "classes": out}
