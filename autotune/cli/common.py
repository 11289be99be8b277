"""What every command shares: the store and engine options, argument types, results as JSON."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from store import StoreError


class CheckFailed(Exception):
    """A check the command runs did not hold (exit 1)."""


def emit(result: dict, path: str | None) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=2))
        print(f"wrote {path}")


def engine_from(args, drafters=None, prefix_cache_tokens: int = 0, compile_: bool | None = None):
    import torch

    from autotune.train.zoo import load_engine

    dtype = getattr(torch, args.dtype) if args.dtype else None
    return load_engine(args.family, device=args.device, drafters=drafters,
                       compile=args.compile if compile_ is None else compile_, dtype=dtype,
                       prefix_cache_tokens=prefix_cache_tokens)


REQUESTS_FILE_HELP = ("your own requests, one JSON object a line: class, prompt, and optionally temperature,"
                      " top_p, max_new_tokens (the classes then come from it)")


def classes_of(args):
    """The request classes a command serves: a requests file's (`--requests-file`), else the
    built-in ones; `--classes` picks among them."""
    from autotune.data.classes import builtin_classes

    if getattr(args, "requests_file", None):
        from autotune.data.requests_file import read_requests

        classes = read_requests(args.requests_file)
        names = args.classes.split(",") if args.classes else list(classes)
        if missing := [n for n in names if n not in classes]:
            raise ValueError(f"unknown request class(es) {missing}; {args.requests_file} has: {sorted(classes)}")
        return {n: classes[n] for n in names}
    classes = builtin_classes(include_shared=False)  # code, docs, edit, creative: the default
    if not args.classes:
        return classes
    names = args.classes.split(",")
    if not set(names) <= set(classes):
        classes = builtin_classes(include_shared=True)  # reads ../shared/corpora only when asked
    missing = [n for n in names if n not in classes]
    if missing:
        raise ValueError(f"unknown request class(es) {missing}; known: {sorted(classes)}")
    return {n: classes[n] for n in names}


def existing_store(url: str | None):
    from store import Store, default_url

    url = url or default_url()
    if url.startswith("sqlite:///"):
        path = Path(url.removeprefix("sqlite:///"))
        if not path.exists():
            raise StoreError(f"no store at {path}; run `autotune demo` or pass --db URL")
    return Store(url, read_only=True)


def cpu_list(text: str) -> set[int]:
    """An argparse type: CPU numbers separated by commas, as taskset's --cpu-list without ranges."""
    try:
        cpus = {int(cpu) for cpu in text.split(",")}
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of CPU numbers such as 1 or 2,3") from None
    if min(cpus) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: CPU numbers start at 0")
    return cpus


def at_least(low: float, kind: type = int, high: float | None = None):
    """An argparse type: a `kind` number in [low, high], refused by argparse (exit 2, naming
    the option) otherwise, rather than accepted and run on silently (a demo of -1 requests) or
    failing far into a run (a tuning study of 0 trials)."""
    allowed = f">= {low}" if high is None else f"in {low}..{high}"

    def parse(text: str):
        value = kind(text)
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its message for a value it cannot parse
    return parse


def add_common(p: argparse.ArgumentParser, engine: bool = True) -> argparse.ArgumentParser:
    """The options every command takes: the store and the result file, and (`engine`) the models."""
    p.add_argument("--db", help="store URL (default: sqlite file in the user data dir)")
    p.add_argument("--json", help="also write the result as JSON to this path")
    if engine:
        p.add_argument("--family", help="model family folder (default: the built-in family)")
        p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
        p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                       help="model dtype (default float32: greedy output exact on every device)")
        p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                       help="compiled decode steps (default: on for CUDA, off for CPU)")
    return p


