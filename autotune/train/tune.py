"""Offline tuning: one Optuna study per request class over the arm space.

Each trial serves a class's prompts on one arm (and, for speculative arms, a K schedule:
constant or transformers' heuristic) and reports goodput after every prompt, so the
pruner stops clearly bad arms early. Studies live in the store's database through
Optuna's RDB storage: re-running continues a study, several processes can tune one study
together, and `optuna-dashboard <url>` shows them. The result seeds the online policy.

A second study per class searches which of the target's layers to skip for self-speculation
(engine/layer_skip.py), as SWIFT does per task with Bayesian optimisation: one yes/no per
layer that may be skipped, and K. Its best sets become the class's layer-skip arms
(`add_tuned_skip_sets`), which the controller then chooses among with the other arms.
"""

from __future__ import annotations

import random
import time

import optuna
from sqlalchemy.exc import IntegrityError, OperationalError, ProgrammingError

from autotune.data.classes import RequestClass
from engine import OFF, Arm, HeuristicK, LayerSkipDrafter, SamplingParams, SpeculativeEngine
from engine.layer_skip import decoder_layers, parse_skip_name, reference_layers, skip_name

STUDY_PREFIX = "autotune:"
SKIP_STUDY_PREFIX = "autotune-layer-skip:"
SKIP_KS = (1, 2, 3, 4)


def study_name(request_class: str) -> str:
    return f"{STUDY_PREFIX}{request_class}"


def skip_study_name(request_class: str) -> str:
    return f"{SKIP_STUDY_PREFIX}{request_class}"


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
    study = _study(study_name(cls.name), url, sampler, seed)
    if not study.trials:
        study.enqueue_trial({"arm": "off"})  # the baseline every other trial is compared with
    prompts = [engine.encode(p).tolist() for p in cls.prompts[:prompts_per_trial]]
    arm_names = [str(a) for a in arms if a != OFF] + ["off"]

    def objective(trial: optuna.Trial) -> float:
        arm = Arm.parse(trial.suggest_categorical("arm", arm_names))
        schedule = None
        if not arm.is_off and trial.suggest_categorical("schedule", ["constant", "heuristic"]) == "heuristic":
            schedule = HeuristicK()
        return _serve_trial(engine, cls, prompts, arm, schedule, trial)

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study.optimize(objective, n_trials=budget, timeout=None if minutes is None else minutes * 60,
                   show_progress_bar=progress)
    return study


def _study(name: str, url: str, sampler: str, seed: int) -> optuna.Study:
    samplers = {"tpe": optuna.samplers.TPESampler, "random": optuna.samplers.RandomSampler}
    if sampler not in samplers:
        raise ValueError(f"unknown sampler {sampler!r}; choose one of {sorted(samplers)}")
    return optuna.create_study(study_name=name, storage=study_storage(url), direction="maximize",
                               sampler=samplers[sampler](seed=seed),
                               pruner=optuna.pruners.MedianPruner(n_startup_trials=4, n_warmup_steps=1),
                               load_if_exists=True)


def skippable_layers(engine: SpeculativeEngine) -> list[int]:
    """The target's layers a skip set may hold (all but those the masks read their sizes from)."""
    _, _, layers = decoder_layers(engine.target)
    return [i for i in range(len(layers))
            if i not in reference_layers(engine.target.config.get_text_config(decoder=True))]


def tune_skip_sets(
    engine: SpeculativeEngine,
    cls: RequestClass,
    url: str,
    budget: int = 20,
    minutes: float | None = None,
    prompts_per_trial: int = 4,
    sampler: str = "tpe",
    seed: int = 0,
    progress: bool = True,
) -> optuna.Study:
    """Search the layers to skip and K for `cls` (SWIFT's search, offline): a trial skips the
    layers whose `skip_<i>` is true and serves the class's prompts on that arm, adding its
    drafter to `engine` if new; no layer skipped is OFF, the baseline, tried first."""
    study = _study(skip_study_name(cls.name), url, sampler, seed)
    layers = skippable_layers(engine)
    if not layers:
        raise ValueError(f"{type(engine.target).__name__} has no layer a skip set may hold")
    if not study.trials:
        study.enqueue_trial({f"skip_{i}": False for i in layers} | {"k": SKIP_KS[0]})
    prompts = [engine.encode(p).tolist() for p in cls.prompts[:prompts_per_trial]]

    def objective(trial: optuna.Trial) -> float:
        skip = {i for i in layers if trial.suggest_categorical(f"skip_{i}", [False, True])}
        k = trial.suggest_categorical("k", list(SKIP_KS))
        if not skip:
            arm = OFF
        else:
            arm = Arm(skip_name(skip), k)
            if arm.drafter not in engine.drafters:
                engine.add_drafter(arm.drafter, LayerSkipDrafter(skip))
        trial.set_user_attr("arm", str(arm))
        return _serve_trial(engine, cls, prompts, arm, None, trial)

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study.optimize(objective, n_trials=budget, timeout=None if minutes is None else minutes * 60,
                   show_progress_bar=progress)
    return study


def _serve_trial(engine: SpeculativeEngine, cls: RequestClass, prompts: list[list[int]], arm: Arm,
                 schedule, trial: optuna.Trial) -> float:
    """Goodput of `prompts` on `arm`, reported after each prompt for the pruner."""
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


def trial_arm(trial: optuna.trial.FrozenTrial) -> str:
    """The arm a trial served (a skip-set trial records it; an arm trial chose it)."""
    return trial.user_attrs.get("arm", trial.params.get("arm"))


def priors_from_study(study: optuna.Study, weight: float = 2.0) -> dict[str, tuple[float, float]]:
    """{arm: (goodput relative to OFF, pseudo-count)} from a study's completed constant-K trials."""
    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    off = [t.value for t in done if trial_arm(t) == "off"]
    if not off:
        return {}
    baseline = sum(off) / len(off)
    by_arm: dict[str, list[float]] = {}
    for t in done:
        if t.params.get("schedule", "constant") == "constant":
            by_arm.setdefault(trial_arm(t), []).append(t.value / baseline)
    return {arm: (sum(v) / len(v), weight) for arm, v in by_arm.items()}


def _tuned_studies(url: str) -> list[tuple[str, str]]:
    """(class, study name) of every tuning study in the store at `url`, both kinds."""
    out = []
    for summary in optuna.get_all_study_summaries(storage=url):
        for prefix in (STUDY_PREFIX, SKIP_STUDY_PREFIX):
            if summary.study_name.startswith(prefix):
                out.append((summary.study_name[len(prefix):], summary.study_name))
    return out


def load_priors(url: str, classes: list[str] | None = None) -> dict[str, dict[str, tuple[float, float]]]:
    """Priors for every class tuned in the store at `url` (from its arm and its skip-set studies,
    each relative to its own OFF)."""
    out: dict[str, dict[str, tuple[float, float]]] = {}
    for name, study in _tuned_studies(url):
        if classes is None or name in classes:
            out.setdefault(name, {}).update(priors_from_study(optuna.load_study(study_name=study, storage=url)))
    return out


def seed_from_studies(controller, url: str) -> dict[str, dict[str, tuple[float, float]]]:
    """Seed `controller`'s policy with the priors of every class tuned in the store at `url`, for
    the arms it serves; returns them."""
    served = {str(a) for a in controller.policy.arms}
    seeded = {}
    for name, priors in load_priors(url).items():
        seeded[name] = {arm: prior for arm, prior in priors.items() if arm in served}
        if seeded[name]:
            controller.policy.set_prior(name, seeded[name])
    return seeded


def tune_by_replay(engine: SpeculativeEngine, store, classes: dict[str, RequestClass], policy: str = "ucb",
                   prompts: int = 4) -> int:
    """Serve `prompts` prompts of each class (the classes in turn) through a controller on `store`
    that replays, on every one, each arm that could still be its class's best, so that the store
    holds a policy an online controller on it resumes from its first request. Returns the
    requests served."""
    from autotune.control.controller import AutotuneController

    controller = AutotuneController(engine, store, policy=policy, counterfactual_requests=prompts)
    served = 0
    try:
        for i in range(prompts):
            for name, cls in classes.items():
                if i < len(cls.prompts):
                    controller.generate(cls.prompts[i], name, cls.max_new_tokens, cls.temperature, cls.top_p, seed=i)
                    served += 1
    finally:
        controller.close()
    return served


def add_tuned_skip_sets(engine: SpeculativeEngine, url: str, per_class: int = 2) -> list[str]:
    """Add to `engine` the `per_class` best skip sets of each class's skip-set study in the store
    at `url` (each at its best K among the trials), so the controller can choose among them;
    returns the drafters added."""
    added = []
    for name, study in _tuned_studies(url):
        if study != skip_study_name(name):
            continue
        priors = priors_from_study(optuna.load_study(study_name=study, storage=url))
        best = sorted((arm for arm in priors if arm != "off"), key=lambda a: -priors[a][0])
        for drafter in list(dict.fromkeys(Arm.parse(arm).drafter for arm in best))[:per_class]:  # a set at two Ks: once
            if drafter not in engine.drafters:
                engine.add_drafter(drafter, LayerSkipDrafter(parse_skip_name(drafter)))
                added.append(drafter)
    return added
