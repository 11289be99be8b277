"""`autotune demo`, `serve` and `inspect`: serve requests through the controller, and read what it learned."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from autotune.cli.common import at_least, emit, engine_from, existing_store
from autotune.cli.models import built_llamacpp


def cmd_demo(args) -> None:
    from autotune.demo import run_demo

    result = run_demo(args.db, args.family, args.device, args.requests, args.policy, args.seed)
    emit(result, args.json)


def _serving_engine(args):
    """The family's engine, or `--target` with its `--drafter NAME=PATH`s and n-gram lookup."""
    if not args.target:
        return engine_from(args, prefix_cache_tokens=args.prefix_cache_tokens)
    import torch

    from engine import NGramDrafter, SpeculativeEngine

    drafters = {}
    for spec in args.drafter or []:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--drafter takes NAME=PATH, got {spec!r}")
        drafters[name] = path
    drafters.setdefault("ngram", NGramDrafter(max_ngram=3))
    dtype = getattr(torch, args.dtype) if args.dtype else None
    return SpeculativeEngine(args.target, drafters, device=args.device, dtype=dtype, compile=args.compile,
                             prefix_cache_tokens=args.prefix_cache_tokens)


def cmd_serve(args) -> None:
    from autotune.control.classifier import RequestClassifier
    from autotune.control.controller import AutotuneController
    from autotune.train.tune import add_tuned_skip_sets, seed_from_studies
    from store import Store

    if args.backend == "llamacpp":
        return _serve_llamacpp(args)
    engine = _serving_engine(args)
    name = args.served_model_name or (Path(args.target).name if args.target else "spec-autotune")
    # --arm: one speculative configuration for every request, as vLLM's --speculative-config (a replica)
    policy = {"policy": "static", "arm": args.arm} if args.arm else {"policy": args.policy}
    with Store(args.db, label="serve") as store:
        if not args.arm:  # the skip sets `autotune tune --layer-skip` found best per class join the arms
            add_tuned_skip_sets(engine, store.url)
        # a first start answers at once: the costs are measured while requests are served OFF
        with AutotuneController(engine, store, max_batch=args.max_batch, prefill_chunk=args.prefill_chunk or None,
                                classifier=RequestClassifier.from_store(store),  # classes of the store's history
                                calibrate_in_background=True, **policy) as controller:
            seed_from_studies(controller, store.url)
            _serve_forever(args, controller, name, f"batches of up to {args.max_batch},"
                           f" {args.prefix_cache_tokens} prompt tokens kept a model")


def _serve_llamacpp(args) -> None:
    """`autotune serve --backend llamacpp`: llama-server processes for the family, the controller
    choosing among them per request."""
    from transformers import AutoConfig, AutoTokenizer

    from autotune.backends import BackendController, LlamaCppBackend, family_servers
    from autotune.backends.serving import ServedBackend
    from autotune.train.zoo import DEFAULT_FAMILY_DIR
    from store import Store

    if args.target or args.arm:
        raise ValueError("--backend llamacpp serves the family (--family), with the controller's --policy;"
                         " --target and --arm are for this project's engine")
    llama, ggufs = built_llamacpp(args)
    family = Path(args.family) if args.family else DEFAULT_FAMILY_DIR
    backend, servers = LlamaCppBackend.start(llama.server, family_servers(ggufs))
    try:
        tokenizer = AutoTokenizer.from_pretrained(family / "target")
        context = AutoConfig.from_pretrained(family / "target").max_position_embeddings
        with Store(args.db, label="serve") as store:
            served = ServedBackend(BackendController(backend, store, policy=args.policy, tokenizer=tokenizer), context)
            try:
                _serve_forever(args, served, args.served_model_name or "spec-autotune",
                               f"on llama.cpp: {len(servers)} llama-server processes")
            finally:
                served.close()
    finally:
        for server in servers:
            server.stop()
        backend.close()


def _serve_forever(args, controller, name: str, what: str) -> None:
    from autotune.serve.server import CompletionServer, ServerLimits, freeze_startup_heap, raise_descriptor_limit

    raise_descriptor_limit()
    limits = ServerLimits(max_body_bytes=args.max_body_bytes, head_timeout_s=args.head_timeout,
                          max_connections=args.max_connections, max_requests=args.max_requests,
                          graceful_shutdown_s=args.shutdown_grace)
    server = CompletionServer(controller, (args.host, args.port), name, verbose=args.verbose,
                              api_key=args.api_key or os.environ.get("AUTOTUNE_API_KEY"),
                              max_metric_classes=args.max_metric_classes, limits=limits,
                              allowed_origins=tuple(args.allowed_origins), loop_nice=args.loop_nice)
    print(f"serving {name!r} at http://{args.host}:{server.server_port}/v1 (policy {args.arm or args.policy},"
          f" {what}); store {controller.store.url}; Ctrl-C or SIGTERM stops", flush=True)
    # uvicorn stops on SIGINT or SIGTERM (requests in flight get their grace), then raises the
    # signal again for the handler it found: here KeyboardInterrupt for both, so the controller
    # saves what it learned before the process ends.
    signal.signal(signal.SIGTERM, _interrupt)
    freeze_startup_heap()
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    print("stopping: saving what the controller learned", flush=True)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def cmd_inspect(args) -> None:
    from autotune.control.inspect_store import format_table, latest_policy, policy_table

    with existing_store(args.db) as store:
        policy = args.policy or latest_policy(store)
        rows = policy_table(store, policy)
        print(f"store: {store.url}\npolicy: {policy or '-'}   observations: {store.count()}\n")
        print(format_table(rows))
    emit({"policy": policy, "classes": rows}, args.json)


def register(sub, common) -> None:
    p = common(sub.add_parser("demo", help="serve a mixed workload through the controller (the main job)"))
    p.add_argument("--requests", type=at_least(1), default=120)
    p.add_argument("--policy", default="ucb")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_demo)

    p = common(sub.add_parser("serve", help="an OpenAI-compatible server over the controller (/v1/completions,"
                                            " /v1/chat/completions)"))
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=at_least(0, high=65535), default=8000, help="0: any free port")
    p.add_argument("--policy", default="ucb")
    p.add_argument("--backend", choices=["engine", "llamacpp"], default="engine",
                   help="serve on this project's engine, or on llama-server processes for the family (built by"
                        " `autotune llamacpp`, here if not yet)")
    p.add_argument("--llamacpp-dir", metavar="DIR", help="--backend llamacpp: where llama.cpp is built (default:"
                                                         " $AUTOTUNE_LLAMACPP_DIR or ~/.cache/autotune)")
    p.add_argument("--arm", help="serve every request on this arm (off, or DRAFTER:K): a replica with one"
                                 " speculative configuration, for a routing backend (autotune/backends/routing.py)")
    p.add_argument("--max-batch", type=at_least(1), default=16,
                   help="requests served together at most (1: one at a time)")
    p.add_argument("--prefill-chunk", type=at_least(0), default=2048, metavar="TOKENS",
                   help="a request joining a batch that decodes is prefilled at most this many tokens a round"
                        " (chunked prefill; 0: in one go)")
    p.add_argument("--prefix-cache-tokens", type=at_least(0), default=8192, metavar="TOKENS",
                   help="each model keeps this many tokens of earlier prompts' keys and values, so a prompt that"
                        " starts as one did prefills only the rest (automatic prefix caching; 0: off)")
    p.add_argument("--target", help="a local Hugging Face model folder to serve instead of the family")
    p.add_argument("--drafter", action="append", metavar="NAME=PATH", help="with --target: a drafter model folder")
    p.add_argument("--served-model-name", help="the model name clients send (default: the target folder's name)")
    p.add_argument("--api-key", help="clients must send `Authorization: Bearer KEY` to every route but /health"
                                      " (default: $AUTOTUNE_API_KEY; none: open)")
    p.add_argument("--max-metric-classes", type=at_least(1), default=100, metavar="N",
                   help="/metrics labels at most N request classes; the others are summed as __other__")
    p.add_argument("--allowed-origins", nargs="*", default=["*"], metavar="ORIGIN",
                   help="CORS: origins whose browser pages may call the server (vLLM's default: any)")
    p.add_argument("--max-body-bytes", type=at_least(1), default=8 << 20, metavar="N",
                   help="a request body longer than this (8 MiB) is refused (413) before it is read")
    p.add_argument("--head-timeout", type=at_least(0.001, float), default=60.0, metavar="SECONDS",
                   help="a connection that has not sent its request's line and headers by then is closed")
    p.add_argument("--max-connections", type=at_least(0), default=0, metavar="N",
                   help="open connections at most; past it the one idle longest is closed (0: what the process's"
                        " descriptor limit leaves, raised up to its hard limit; at most 65,536)")
    p.add_argument("--max-requests", type=at_least(1), default=4096, metavar="N",
                   help="requests in flight at most; past it a 503")
    p.add_argument("--shutdown-grace", type=at_least(0.0, float), default=10.0, metavar="SECONDS",
                   help="on SIGTERM or Ctrl-C new requests get a 503 and those running may finish for this"
                        " long; a stream still running then ends with finish_reason \"abort\" and [DONE]")
    p.add_argument("--loop-nice", type=at_least(0, high=19), default=19, metavar="N",
                   help="the HTTP event loop runs N steps below the engine's worker in CPU priority (Linux), so"
                        " connections' work (floods of connects, waves of closes) waits for decoding; it waits for"
                        " other busy processes in the server's scheduling group too (Linux's autogroup: its session;"
                        " 0: level, for a server sharing its session with them)")
    p.add_argument("--verbose", action="store_true", help="log every HTTP request")
    p.set_defaults(func=cmd_serve)

    p = common(sub.add_parser("inspect", help="per-class table of what a policy learned"), engine=False)
    p.add_argument("--policy", help="policy name (default: the one saved last)")
    p.set_defaults(func=cmd_inspect)
