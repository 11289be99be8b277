"""`autotune tune`: offline Optuna studies per request class."""

from __future__ import annotations

from autotune.cli.common import REQUESTS_FILE_HELP, at_least, classes_of, emit, engine_from


def cmd_tune(args) -> None:
    from autotune.control.controller import default_arms
    from autotune.train.tune import priors_from_study, tune_class, tune_skip_sets
    from store import Store

    classes = classes_of(args)  # a bad requests file is refused before the models load
    engine = engine_from(args)
    if args.method == "replay":
        from autotune.train.tune import tune_by_replay

        with Store(args.db, label="tune") as store:
            served = tune_by_replay(engine, store, classes, args.policy, args.prompts)
            print(f"{args.policy} learned from {served} requests of {len(classes)} classes in {store.url};"
                  f" `autotune serve --db {store.url} --policy {args.policy}` resumes it")
            emit({"store": store.url, "method": "replay", "policy": args.policy, "requests": served,
                  "classes": list(classes)}, args.json)
        return
    with Store(args.db, label="tune") as store:
        url = store.url
    result = {"store": url, "classes": {}}
    for name, cls in classes.items():
        print(f"tuning {name} ({args.budget} trials) in {url}")
        study = tune_class(engine, cls, url, default_arms(engine), budget=args.budget, minutes=args.minutes,
                           prompts_per_trial=args.prompts, sampler=args.sampler, progress=not args.no_progress)
        best = study.best_trial
        result["classes"][name] = {"best_params": best.params, "best_goodput": round(best.value, 2),
                                   "trials": len(study.trials), "priors": priors_from_study(study)}
        print(f"  best {best.params} at {best.value:.1f} tokens/s after {len(study.trials)} trials")
        if args.layer_skip:
            print(f"searching {name}'s layers to skip ({args.budget} trials)")
            study = tune_skip_sets(engine, cls, url, budget=args.budget, minutes=args.minutes,
                                   prompts_per_trial=args.prompts, sampler=args.sampler, progress=not args.no_progress)
            priors = priors_from_study(study)
            result["classes"][name]["layer_skip"] = {"trials": len(study.trials), "priors": priors}
            best = max(priors, key=lambda a: priors[a][0], default="off")
            print(f"  best {best} at {priors.get(best, (1.0,))[0]:.2f}x OFF")
    print(f"\nopen the studies with: optuna-dashboard {url}")
    emit(result, args.json)


def register(sub, common) -> None:
    p = common(sub.add_parser("tune", help="offline Optuna study per request class"))
    p.add_argument("--classes", help="comma-separated classes (default: code,docs,edit,creative)")
    p.add_argument("--requests-file", metavar="JSONL", help=REQUESTS_FILE_HELP)
    p.add_argument("--budget", type=at_least(1), default=20, help="trials per class")
    p.add_argument("--minutes", type=at_least(0.01, float), help="time limit per class")
    p.add_argument("--prompts", type=at_least(1), default=4,
                   help="prompts per trial (--method replay: prompts per class)")
    p.add_argument("--method", choices=["optuna", "replay"], default="optuna",
                   help="optuna: a study per class, whose results seed the served policy; replay: serve"
                        " --prompts prompts a class through the controller, each replayed on every arm that"
                        " could be its class's best, into the store's policy, which `autotune serve` resumes")
    p.add_argument("--policy", default="ucb", help="--method replay: the policy that learns (as served)")
    p.add_argument("--sampler", default="tpe", choices=["tpe", "random"])
    p.add_argument("--layer-skip", action="store_true",
                   help="also search which target layers to skip for self-speculation, per class")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_tune)
