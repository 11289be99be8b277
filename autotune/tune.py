"""Offline tuning: one Optuna study per request class over the arm space.

Each trial serves a class's prompts on one arm (and, for speculative arms, a K schedule:
constant or transformers' heuristic) and reports goodput after every prompt, so the
pruner stops clearly bad arms early. Studies live in the store's database through
Optuna's RDB storage: re-running continues a study, several processes can tune one study
together, and `optuna-dashboard <url>` shows them. The result seeds the online policy.
"""

from __future__ import annotations

import random
import time

import optuna
from sqlalchemy.exc import IntegrityError, OperationalError, ProgrammingError

from autotune.classes import RequestClass
from engine import OFF, Arm, HeuristicK, SamplingParams, SpeculativeEngine

STUDY_PREFIX = "autotune:"


def study_name(request_class: str) -> str:
    return f"{STUDY_PREFIX}{request_class}"


def study_storage(url: str, attempts: int = 5) -> optuna.storages.RDBStorage:
    """Optuna's storage in the store's database at `url`. Processes that create its tables at
    once collide (two `autotune tune` on a new store: "table ... already exists" or a unique key of
    alembic_version on SQLite, a type's name on PostgreSQL); the later one then finds them made,
    so it tries again."""
    for _ in range(attempts - 1):
        try:
            return optuna.storages.RDBStorage(url)
        except (IntegrityError, OperationalError, ProgrammingError):
            time.sleep(random.uniform(0.1, 0.5))
    return optuna.storages.RDBStorage(url)


def tune_class(
    engine: SpeculativeEngine,
    cls: RequestClass,
    url: str,
    arms: list[Arm],
    budget: int = 20,
    minutes: float | None = None,
    prompts_per_trial: int = 4,
    sampler: str = "tpe",
    seed: int = 0,
    progress: bool = True,
) -> optuna.Study:
    samplers = {"tpe": optuna.samplers.TPESampler, "random": optuna.samplers.RandomSampler}
    if sampler not in samplers:
        raise ValueError(f"unknown sampler {sampler!r}; choose one of {sorted(samplers)}")
    study = optuna.create_study(
        study_name=study_name(cls.name),
        storage=study_storage(url),
        direction="maximize",
        sampler=samplers[sampler](seed=seed),
        pruner=optuna.pruners.MedianPruner(n_startup_trials=4, n_warmup_steps=1),
        load_if_exists=True,
    )
    if not study.trials:
        study.enqueue_trial({"arm": "off"})  # the baseline every other trial is compared with
    prompts = [engine.encode(p).tolist() for p in cls.prompts[:prompts_per_trial]]
    arm_names = [str(a) for a in arms if a != OFF] + ["off"]

    def objective(trial: optuna.Trial) -> float:
        arm = Arm.parse(trial.suggest_categorical("arm", arm_names))
        schedule = None
        if not arm.is_off and trial.suggest_categorical("schedule", ["constant", "heuristic"]) == "heuristic":
            schedule = HeuristicK()
        tokens, seconds, drafted, accepted = 0, 0.0, 0, 0
        for step, ids in enumerate(prompts):
            sampling = SamplingParams(cls.temperature, cls.top_p, seed=step)
            r = engine.generate(ids, arm, cls.max_new_tokens, sampling, schedule)
            tokens += r.metrics.new_tokens
            seconds += r.metrics.total_s
            drafted += r.metrics.drafted
            accepted += r.metrics.accepted
            trial.report(tokens / seconds, step)
            if trial.should_prune():
                raise optuna.TrialPruned()
        trial.set_user_attr("acceptance", accepted / drafted if drafted else None)
        return tokens / seconds

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study.optimize(objective, n_trials=budget, timeout=None if minutes is None else minutes * 60,
                   show_progress_bar=progress)
    return study


def priors_from_study(study: optuna.Study, weight: float = 2.0) -> dict[str, tuple[float, float]]:
    """{arm: (goodput relative to OFF, pseudo-count)} from a study's completed constant-K trials."""
    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    off = [t.value for t in done if t.params.get("arm") == "off"]
    if not off:
        return {}
    baseline = sum(off) / len(off)
    by_arm: dict[str, list[float]] = {}
    for t in done:
        if t.params.get("schedule", "constant") == "constant":
            by_arm.setdefault(t.params["arm"], []).append(t.value / baseline)
    return {arm: (sum(v) / len(v), weight) for arm, v in by_arm.items()}


def load_priors(url: str, classes: list[str] | None = None) -> dict[str, dict[str, tuple[float, float]]]:
    """Priors for every class tuned in the store at `url`."""
    out = {}
    for summary in optuna.get_all_study_summaries(storage=url):
        if not summary.study_name.startswith(STUDY_PREFIX):
            continue
        name = summary.study_name[len(STUDY_PREFIX):]
        if classes is None or name in classes:
            out[name] = priors_from_study(optuna.load_study(study_name=summary.study_name, storage=url))
    return out
