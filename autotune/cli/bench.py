"""`autotune bench WHAT`: each benchmark's options, its run, and the check that fails it."""

from __future__ import annotations

import functools
import json
from pathlib import Path

from autotune.cli.common import REQUESTS_FILE_HELP, CheckFailed, at_least, classes_of, cpu_list, emit, engine_from
from autotune.cli.models import built_llamacpp

PREFIX_BENCH_TOKENS = 8192  # bench prefix: what each model keeps of earlier prompts (serve's default)
LEARNING_POLICIES = "ucb,contextual"  # bench controller --many-classes, bench backends: policies compared by default


def _print_limits(result: dict) -> None:
    t = result["target"]
    print(f"{result['device']}, {result['cache']} steps, {result['dtype']}; copy bandwidth "
          f"{result['copy_bandwidth_GBps']} GB/s")
    print(f"target: {t['weight_MB']} MB of weights per step, {t['step_ms']} ms per step = {t['tokens_per_s']} tokens/s,"
          f" {t['fraction_of_limit']:.0%} of the bandwidth limit ({t['bandwidth_limit_tokens_per_s']} tokens/s)")
    costs = result["verify_cost_vs_one_token"]
    print("verify K+1 tokens / 1 token: " + ", ".join(f"K={k}: {v}" for k, v in costs.items()))
    for name, d in result["drafters"].items():
        print(f"drafter {name}: {d['weight_MB']} MB, {d['step_ms']} ms per step, cost ratio {d['cost_ratio']}")


def cmd_bench(args) -> None:
    """Run one `autotune bench` command: print its result, write it as JSON, and fail (exit 1)
    where a benchmark's own check of the outputs did."""
    from autotune import bench

    if args.what in ("store", "durability"):
        result = _bench_databases(args, bench)
    elif args.what == "hostile":
        result = bench.bench_hostile(classes=args.requests or 300, policy=args.policies or "ucb",
                                     idle=args.idle, slow=args.slow, attacker_nice=args.attacker_nice,
                                     attacker_cpus=args.attacker_cpus, server_code=args.server_code)
    elif args.what == "decisions":
        steps = {"decisions": 300 if args.quick else 3000, "warmup": 100 if args.quick else 500}
        result = bench.bench_decisions(**steps)
        result["many_classes"] = bench.bench_decisions(**steps, classes=tuple(f"tenant-{i}" for i in range(1000)))
    elif args.what == "backends":
        result = _bench_backends(args, bench)
    elif args.what == "limits":
        engine = (bench.llama_shaped_engine(args.device, compile=args.compile) if args.llama_shapes
                  else engine_from(args))
        result = bench.bench_limits(engine, max_k=4 if args.quick else args.max_k)
    else:
        engine = engine_from(args, prefix_cache_tokens=PREFIX_BENCH_TOKENS if args.what == "prefix" else 0)
        result = _BENCHES[args.what](args, engine, bench)
    _show(args, result)
    emit(result, args.json)
    if args.what in _FAILURES and (failure := _FAILURES[args.what](result)):
        raise CheckFailed(failure)


def _bench_backends(args, bench) -> dict:
    """The controller on llama.cpp against every static setting, and this engine against llama.cpp."""
    from transformers import AutoTokenizer

    from autotune.backends import LLAMA_CPP_PYTHON, LlamaCppBackend, family_servers
    from autotune.bench.tenants import tenant_classes
    from autotune.data.classes import builtin_classes
    from autotune.train.zoo import DEFAULT_FAMILY_DIR

    llama, ggufs = built_llamacpp(args)
    family = Path(args.family) if args.family else DEFAULT_FAMILY_DIR
    specs = family_servers(ggufs)
    backend, servers = LlamaCppBackend.start(llama.server, specs, cache_prompt=False)
    try:
        tokenizer = AutoTokenizer.from_pretrained(family / "target")
        classes = classes_of(args)
        if args.many_classes:
            classes = tenant_classes(classes, args.many_classes)
        result = {"llama_cpp_python": LLAMA_CPP_PYTHON, "servers": [s.spec.name for s in servers]}
        result["controller"] = bench.bench_backend_controller(
            backend, classes, tokenizer, 3 if args.quick else args.per_class or 50, backend.arms(),
            (args.policies or LEARNING_POLICIES).split(","))
        peer_classes = [builtin_classes(include_shared=False)[name] for name in ("code", "edit")]
        count = 2 if args.quick else args.prompts
        prompts = [tokenizer.encode(p) for c in peer_classes for p in c.prompts[:count]]
        engines = {"eager": engine_from(args, compile_=False), "compiled": engine_from(args, compile_=True)}
        result["peer"] = bench.bench_peer(backend, engines, prompts * 2, args.max_new_tokens)
    finally:
        for server in servers:
            server.stop()
        backend.close()
    return result


def _bench_databases(args, bench) -> dict:
    """`bench store` and `bench durability`, on SQLite and (--postgres) PostgreSQL, fresh stores each."""
    databases = ["sqlite"] + (["postgresql"] if args.postgres else [])
    result = {}
    with bench.fresh_stores(args.postgres) as fresh:
        for database in databases:
            if args.what == "store":
                result[database] = bench.bench_store(fresh(database, "store"), 1000 if args.quick else 5000)
            else:
                result[database] = bench.bench_durability(functools.partial(fresh, database),
                                                          lives=4 if args.quick else 12,
                                                          requests=10 if args.quick else 30)
    return result


def _show(args, result: dict) -> None:
    what = args.what
    if what == "limits":
        _print_limits(result)
    elif what == "arms":
        _print_arms(result)
    elif what == "replay":
        print(json.dumps({k: v for k, v in result.items() if k != "classes"}, indent=2))
    elif what == "controller" and "ground_truth" in result:
        print(json.dumps({k: v for k, v in result.items() if k not in ("goodput", "ground_truth")}, indent=2))
        print(f"plots: {args.out}/controller_arms.png, {args.out}/controller_regret.png")
    else:
        print(json.dumps(result, indent=2))


def _bench_engine(args, engine, bench) -> dict:
    from autotune.data.classes import builtin_classes
    from engine import Arm

    prompts = list(builtin_classes(include_shared=False)["code"].prompts[: 3 if args.quick else args.prompts])
    return bench.bench_engine(engine, prompts, Arm.parse(args.arm), 32 if args.quick else args.max_new_tokens,
                              args.repetition_penalty, args.no_repeat_ngram)


def _bench_lossless(args, engine, bench) -> dict:
    from engine import Arm

    arms = [Arm.parse(a) for a in args.arms.split(",")] if args.arms else [Arm(d, 4) for d in engine.drafters]
    return bench.bench_lossless(engine, classes_of(args), arms, args.prompts, args.max_new_tokens)


def _bench_cache(args, engine, bench) -> dict:
    from engine import Arm

    sizes = {1: 2, 4: 1} if args.quick else {1: 8, 16: 4, 64: 3}  # batch size -> batches served
    cases = [(size, name, arm, repeats) for size, repeats in sizes.items() for name in ("code", "creative")
             for arm in (Arm(), Arm.parse("ngram+distilled:2" if size > 1 else "ngram+distilled:4"))]
    return bench.bench_cache(engine, classes_of(args), cases)


def _off_and_hybrid(args) -> list:
    from engine import Arm

    return [Arm()] if args.quick else [Arm(), Arm.parse("ngram+distilled:2")]


def _bench_longrun(args, engine, bench) -> dict:
    return bench.bench_long_batch(engine, classes_of(args), _off_and_hybrid(args), 4 if args.quick else args.batch_size,
                                  24 if args.quick else args.requests or 320, 1 if args.quick else 2)


def _bench_choices(args, engine, bench) -> dict:
    cls = classes_of(args)["creative" if not args.classes else args.classes.split(",")[0]]
    return bench.bench_choices(engine, cls, _off_and_hybrid(args), 4 if args.quick else args.n,
                               1 if args.quick else args.prompts, 128 if args.quick else 512)


def _bench_lengths(args, engine, bench) -> dict:
    return bench.bench_lengths(engine, classes_of(args), _off_and_hybrid(args), 8 if args.quick else args.batch_size,
                               1 if args.quick else args.prompts)


def _bench_chunked(args, engine, bench) -> dict:
    chunks = (None, 64) if args.quick else (None, *args.prefill_chunk)
    result = bench.bench_chunked(engine, classes_of(args), _off_and_hybrid(args), chunks, rows=4 if args.quick else 8,
                                 joins=2 if args.quick else 6, long_tokens=200 if args.quick else 900,
                                 every=8 if args.quick else 24, rounds=1 if args.quick else 2)
    result["clients"] = bench.bench_chunked_clients(engine, classes_of(args), chunks,
                                                    *((4, 2, 1) if args.quick else (args.clients, 4, 3)))
    return result


def _bench_prefix(args, engine, bench) -> dict:
    cls = classes_of(args)["code" if not args.classes else args.classes.split(",")[0]]
    context = 200 if args.quick else args.context_tokens
    result = bench.bench_prefix(engine, cls, _off_and_hybrid(args), context, 4 if args.quick else args.requests or 24,
                                2 if args.quick else 8)
    result["clients"] = bench.bench_prefix_clients(engine, classes_of(args), context,
                                                   *((4, 2, 1) if args.quick else (args.clients, 4, 2)))
    return result


def _bench_clients(args, engine, bench) -> dict:
    clients, per_client = (8, 2) if args.quick else (args.clients, 4)
    rounds = 1 if args.quick else args.rounds
    if args.what == "concurrency":
        return bench.bench_concurrency(engine, classes_of(args), clients, per_client, max_batch=clients, rounds=rounds)
    others = dict(_named(item) for item in args.compare_url or ())
    policies = tuple(p for p in args.policies.split(",") if p) if args.policies is not None else ("off", "ucb")
    return bench.bench_serve(engine, classes_of(args), clients, per_client, max_batch=clients, policies=policies,
                             rounds=rounds, others=others)


def _named(item: str) -> tuple[str, str]:
    name, sep, url = item.partition("=")
    if not sep or not name or not url.startswith("http"):
        raise SystemExit(f"--compare-url takes NAME=URL (e.g. old=http://127.0.0.1:8001), got {item!r}")
    return name, url


def _every_arm(engine, ks) -> list:
    from engine import Arm

    return [Arm()] + [Arm(d, k) for d in engine.drafters for k in ks]


def _bench_layer_skip(args, engine, bench) -> dict:
    return bench.bench_layer_skip(engine, classes_of(args), tune_prompts=2 if args.quick else 3,
                                  eval_prompts=2 if args.quick else args.prompts,
                                  budget=6 if args.quick else args.budget,
                                  max_new_tokens=32 if args.quick else args.max_new_tokens)


def _bench_replay(args, engine, bench) -> dict:
    arms = _every_arm(engine, (2, 4) if args.quick else (1, 2, 4, 8))
    return bench.bench_replay(engine, classes_of(args), arms, 2 if args.quick else args.prompts)


def _bench_rewards(args, engine, bench) -> dict:
    from autotune.bench.reward_scale import DEFAULT_ARMS
    from engine import Arm

    named = _named_arms(args.arms, (4, 8)) if args.arms else \
        [Arm.parse(a) for a in DEFAULT_ARMS if Arm.parse(a).drafter in engine.drafters]
    arms = [a for a in named if not a.is_off]  # each is measured beside OFF
    for arm in arms:
        engine.check_request(1, arm, 1)  # an unknown drafter is named before anything runs
    return bench.bench_reward_scale(engine, classes_of(args), arms, 2 if args.quick else args.prompts)


def _named_arms(text: str, ks: tuple[int, ...]) -> list:
    """Arms as `--arms` names them: `off`, `DRAFTER:K`, or `DRAFTER:*` for every K in `ks`."""
    from engine import Arm

    arms = []
    for name in text.split(","):
        arms += [Arm(name[:-2], k) for k in ks] if name.endswith(":*") else [Arm.parse(name)]
    return arms


def _bench_arms(args, engine, bench) -> dict:
    from engine import OFF

    ks = (2, 4) if args.quick else bench.BENCH_KS
    named = _named_arms(args.arms, ks) if args.arms else _every_arm(engine, ks)
    arms = [OFF] + [a for a in named if a != OFF]  # every speedup is over OFF, measured beside it
    for arm in arms:
        engine.check_request(1, arm, 1)  # an unknown drafter is named before anything runs
    return bench.bench_arms(engine, classes_of(args), arms, 2 if args.quick else args.prompts,
                            32 if args.quick else None, batch=args.batch, coupled=args.coupled)


def _bench_controller(args, engine, bench) -> dict:
    """Policies against static arms and the per-class oracle: on many tenant classes
    (`--many-classes`), on the classes of a requests file (`--requests-file`), or on the built-in
    classes against a ground truth of every arm."""
    if args.many_classes or args.requests_file:
        from autotune.bench.tenants import STATIC_ARMS, tenant_classes

        classes = classes_of(args)
        if not args.requests_file:
            classes = tenant_classes(classes, 6 if args.quick else args.many_classes)
        chosen = json.loads(Path(args.arms_from).read_text()) if args.arms_from else None
        statics = ["off", *(a for a in args.arms.split(",") if a != "off")] if args.arms else STATIC_ARMS
        with _noise(args.noise, engine) as noise:
            result = bench.bench_many_classes(engine, classes, Path(args.out), 2 if args.quick else args.per_class or 8,
                                              policies=(args.policies or LEARNING_POLICIES).split(","),
                                              statics=statics, chosen=chosen, warm_start=args.warm_start,
                                              noise=noise if args.noise == "delays" else None)
        result["noise"] = args.noise
        return result
    from autotune.data.classes import Workload

    classes = classes_of(args)
    truth = {}  # batch size -> ground truth
    for path in args.arms_json or []:
        measured = json.loads(Path(path).read_text())
        truth[measured.get("batch", 1)] = measured
    bursts = args.burst_share > 0
    for size in sorted({1, args.burst_size} if bursts else {1}):
        if size not in truth:
            print(f"measuring ground truth per class first (bench arms --batch {size})")
            truth[size] = bench.bench_arms(engine, classes, _every_arm(engine, bench.BENCH_KS),
                                           2 if args.quick else args.prompts, batch=size)
    names = list(classes)
    n = 40 if args.quick else args.requests or 160
    load = {"burst_share": args.burst_share, "burst_size": args.burst_size}
    flipped = {name: (3.0 if i >= len(names) // 2 else 0.3) for i, name in enumerate(names)}
    unflipped = {name: (0.3 if i >= len(names) // 2 else 3.0) for i, name in enumerate(names)}
    drift = Workload(unflipped, n_requests=n, seed=1, drift=((0.5, flipped),), **load)
    with _noise(args.noise, engine) as noise:
        result = bench.bench_controller(engine, classes, truth, Workload({name: 1.0 for name in names}, n_requests=n,
                                                                         seed=0, **load),
                                        Path(args.out), drift=None if args.no_drift else drift,
                                        noise=noise if args.noise == "delays" else None)
    result["noise"] = args.noise
    result["ground_truth"] = {str(size): t for size, t in truth.items()}
    return result


_BENCHES = {
    "engine": _bench_engine, "lossless": _bench_lossless, "cache": _bench_cache, "longrun": _bench_longrun,
    "choices": _bench_choices, "lengths": _bench_lengths, "chunked": _bench_chunked, "prefix": _bench_prefix,
    "concurrency": _bench_clients, "serve": _bench_clients, "replay": _bench_replay, "arms": _bench_arms,
    "controller": _bench_controller, "layer-skip": _bench_layer_skip, "rewards": _bench_rewards,
}


def _same_outputs(*keys: str, differ: str):
    """A check that fails, saying where outputs `differ`, unless every flag at `keys` (a.b: nested) is true."""
    def failure(result: dict) -> str | None:
        for key in keys:
            value = result
            for part in key.split("."):
                value = value[part]
            if not value:
                return f"outputs differ between {differ}"
        return None
    return failure


def _lossless_failure(result: dict) -> str | None:
    if result["dtype"] == "float32" and result["identical"] < result["requests"]:
        return f"{result['requests'] - result['identical']} float32 outputs differ from generate()"
    return None


# Benchmarks that compare outputs fail the command (exit 1) when they differ.
_FAILURES = {
    "lossless": _lossless_failure,
    "longrun": _same_outputs("identical_outputs", differ="a batch that drops its holes and one that keeps them"),
    "choices": _same_outputs("identical_outputs", differ="a shared and an unshared prefill"),
    "lengths": _same_outputs("identical_outputs", differ="grouped and one-forward prefills"),
    "chunked": _same_outputs("identical_outputs", "clients.identical_outputs", differ="chunked and whole prefills"),
    "prefix": _same_outputs("identical_outputs", "clients.identical_greedy_outputs",
                            differ="prompts prefilled whole and from kept prefixes"),
    "concurrency": _same_outputs("identical_greedy_outputs", differ="configurations (greedy)"),
    "serve": _same_outputs("identical_greedy_outputs", differ="configurations (greedy)"),
}


def _noise(kind: str | None, engine):
    """Other work beside the benchmark (`--noise`): bursts of slowed forwards, or CPU hogs."""
    from contextlib import nullcontext

    from autotune.bench.noise import CpuHog, InjectedDelays
    from engine.drafters import model_drafter_of

    if kind == "delays":
        models = [engine.target, *{m.model for d in engine.drafters.values() if (m := model_drafter_of(d))}]
        return InjectedDelays(models)
    return CpuHog() if kind == "hog" else nullcontext()


def _print_arms(result: dict) -> None:
    from autotune.control.inspect_store import format_table

    for name, cls in result["classes"].items():
        print(f"\n{name}: best arm {cls['best_arm']}, loop rate {cls['loop_rate']}")
        print(format_table([{"arm": a, **v} for a, v in cls["arms"].items()]))


def register(sub, common) -> None:
    p = common(sub.add_parser("bench", help="benchmarks: engine, lossless, arms, replay, controller, decisions,"
                                            " store, durability, limits, cache, longrun, choices, lengths, chunked,"
                                            " prefix, concurrency, serve, hostile, backends, layer-skip, rewards"))
    p.add_argument("what", choices=["engine", "lossless", "arms", "replay", "controller", "decisions", "store",
                                    "durability", "limits", "cache", "longrun", "choices", "lengths", "chunked",
                                    "prefix", "concurrency", "serve", "hostile", "backends", "layer-skip",
                                    "rewards"])
    p.add_argument("--llamacpp-dir", metavar="DIR", help="bench backends: where llama.cpp is built (default:"
                                                         " $AUTOTUNE_LLAMACPP_DIR or ~/.cache/autotune)")
    p.add_argument("--postgres", metavar="URL", help="bench store, durability: also on fresh databases created on"
                                                     " this PostgreSQL server (`.ci/postgres start DIR` prints one)")
    p.add_argument("--quick", action="store_true", help="a small smoke version")
    p.add_argument("--arm", default="distilled:3", help="bench engine: the speculative arm")
    p.add_argument("--repetition-penalty", type=at_least(0.01, float), default=1.0,
                   help="bench engine: every method decodes with this repetition penalty")
    p.add_argument("--no-repeat-ngram", type=at_least(0), default=0, metavar="N",
                   help="bench engine: no method repeats an N-gram (the engine through a caller's logits processor)")
    p.add_argument("--arms", help="bench lossless: comma-separated arms (default: every drafter at K=4); bench"
                                  " arms: the arms to measure, DRAFTER:* for every K (default: every drafter, every K);"
                                  " bench rewards: the arms priced (default: n-gram, model, feature and hybrid ones);"
                                  " bench controller --many-classes or --requests-file: the static arms"
                                  " served beside OFF")
    p.add_argument("--prompts", type=at_least(1), default=6, help="prompts (per class)")
    p.add_argument("--budget", type=at_least(1), default=16, help="bench layer-skip: skip-set trials per class")
    p.add_argument("--max-new-tokens", type=at_least(1), default=64)
    p.add_argument("--classes", help="comma-separated classes (default: code,docs,edit,creative)")
    p.add_argument("--requests-file", metavar="JSONL", help=REQUESTS_FILE_HELP)
    p.add_argument("--requests", type=at_least(1),
                   help="bench controller: stream length (default 160); longrun: requests served (default 320);"
                        " prefix: requests per case (default 24); hostile: distinct request classes (default 300)")
    p.add_argument("--batch", type=at_least(1), default=1,
                   help="bench arms: serve each class's first N prompts together as one batch (load N)")
    p.add_argument("--coupled", action="store_true",
                   help="bench arms: sample by the drafter-invariant rule (a seeded request's default) rather"
                        " than the standard rejection rule")
    p.add_argument("--arms-json", action="append",
                   help="bench controller: ground truth from `bench arms --json` (once per batch size)")
    p.add_argument("--burst-share", type=at_least(0, float, high=1), default=0.0,
                   help="bench controller: share of arrivals that are a burst served as one batch")
    p.add_argument("--burst-size", type=at_least(1), default=16, help="bench controller: requests per burst")
    p.add_argument("--clients", type=at_least(1), default=16,
                   help="bench concurrency, serve, prefix: client threads, each sending 4 requests one after another")
    p.add_argument("--idle", type=at_least(0), default=20_000,
                   help="bench hostile: idle connections held (0 with --slow 0: the same series unattacked, a control)")
    p.add_argument("--slow", type=at_least(0), default=50, help="bench hostile: clients sending a head a byte a second")
    p.add_argument("--attacker-nice", type=at_least(0, high=19), default=0,
                   help="bench hostile: the attacking processes' nice value (19: the least CPU, as attackers on"
                        " machines of their own would take none of the server's)")
    p.add_argument("--attacker-cpus", type=cpu_list, metavar="LIST",
                   help="bench hostile: CPUs the attacking processes run on (e.g. 1 or 2,3), the server on the others")
    p.add_argument("--server-code", metavar="DIR",
                   help="bench hostile: run the server from this checkout's code (e.g. a git worktree of an older"
                        " commit), driven by this one's bench")
    p.add_argument("--compare-url", action="append", metavar="NAME=URL",
                   help="bench serve: also serve the same clients from a server started elsewhere (e.g. another"
                        " build of autotune serve, on the same family), in the same turns; servers named new-X and"
                        " old-X are also compared round by round")
    p.add_argument("--out", default="bench-out", help="bench controller: folder for stores and plots")
    p.add_argument("--no-drift", action="store_true", help="bench controller: skip the drift/restart run")
    p.add_argument("--many-classes", type=at_least(2), metavar="N",
                   help="bench controller: N classes (the chosen ones, then sampled and short variants of them),"
                        " a few requests each, every request served by every configuration, counted from the first")
    p.add_argument("--warm-start", type=at_least(1), metavar="N",
                   help="bench controller: also serve with policies warm-started offline on N other prompts"
                        " a class (policy name + '-warm')")
    p.add_argument("--per-class", type=at_least(1), help="bench controller --many-classes: requests per class"
                                                          " (default 8); bench backends: (default 50)")
    p.add_argument("--policies", help="bench controller --many-classes: policies compared (default"
                                      f" {LEARNING_POLICIES});"
                                      " bench serve: policies served in process, directly and over HTTP (default"
                                      " off,ucb; empty: only the --compare-url servers); bench hostile: the"
                                      " server's policy (default ucb; off: its arm fixed, so the normal"
                                      " requests' latency is the server's alone)")
    p.add_argument("--rounds", type=at_least(1), default=2,
                   help="bench serve, concurrency: rounds in which every configuration serves the clients in turn")
    p.add_argument("--arms-from", metavar="JSON", help="bench controller --many-classes: the static best and oracle"
                                                       " arms of an earlier run's JSON, instead of hindsight picks")
    p.add_argument("--noise", choices=["delays", "hog"],
                   help="bench controller: a noisy machine, bursts of slowed forward passes (delays) or two"
                        " processes keeping the cores busy (hog)")
    p.add_argument("--n", type=at_least(1), default=8, help="bench choices: choices per request")
    p.add_argument("--batch-size", type=at_least(1), default=16, help="bench lengths, longrun: requests per batch")
    p.add_argument("--prefill-chunk", type=at_least(1), nargs="+", default=[512, 2048], metavar="TOKENS",
                   help="bench chunked: chunk sizes compared with prefilling in one go")
    p.add_argument("--context-tokens", type=at_least(1), default=600, metavar="TOKENS",
                   help="bench prefix: the context every request starts with")
    p.add_argument("--max-k", type=at_least(1, high=16), default=16,
                   help="bench limits: verify steps of up to K+1 tokens")
    p.add_argument("--llama-shapes", action="store_true",
                   help="bench limits: random bf16 models shaped like Llama-3.1-8B / Llama-3.2-1B (CUDA)")
    p.set_defaults(func=cmd_bench)
