"""`autotune`: demo, serve, tune, inspect, bench (engine, lossless, arms, controller, ...), zoo train.

Exit codes: 0 success, 1 failure while running, 2 bad usage or bad input, 3 missing or
unreadable store.
"""

from __future__ import annotations

import argparse
import sys

from autotune.cli import bench, models, serve, tune
from autotune.cli.common import CheckFailed, add_common
from store import StoreError

EXIT_FAILURE, EXIT_USAGE, EXIT_STORE = 1, 2, 3


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="autotune", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for group in (serve, tune, bench, models):
        group.register(sub, add_common)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a bar per model loaded would open every command's output
    try:
        args.func(args)
    except StoreError as exc:
        print(f"autotune: store error: {exc}", file=sys.stderr)
        return EXIT_STORE
    except (ValueError, KeyError, FileNotFoundError) as exc:
        print(f"autotune: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except CheckFailed as exc:
        print(f"autotune: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        return EXIT_FAILURE
    return 0
