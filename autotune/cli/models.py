"""`autotune llamacpp` and `autotune zoo`: build llama.cpp for the family, and train the family."""

from __future__ import annotations

import json
from pathlib import Path

from autotune.cli.common import at_least
from autotune.data.corpus import DOMAINS

LLAMACPP_MEMBERS = ("target", "distilled", "small", "medium")  # the family members llama.cpp serves


def built_llamacpp(args):
    """llama-server built and the family converted (each step skipped when done): the build and
    {member: GGUF file}."""
    from autotune.backends import setup
    from autotune.train.zoo import DEFAULT_FAMILY_DIR

    family = Path(args.family) if args.family else DEFAULT_FAMILY_DIR
    print("llama.cpp: building llama-server and converting the family where not done yet", flush=True)
    return setup({n: family / n for n in LLAMACPP_MEMBERS}, Path(args.llamacpp_dir) if args.llamacpp_dir else None)


def cmd_llamacpp(args) -> None:
    llama, ggufs = built_llamacpp(args)
    print(json.dumps({"llama_server": str(llama.server), **{n: str(path) for n, path in ggufs.items()}},
                     indent=2))


def cmd_zoo_train(args) -> None:
    from autotune.data.corpus import shared_corpora_dir
    from autotune.train.zoo import FamilySpec, train_family

    corpora = None
    if args.corpora is not None:
        corpora = Path(args.corpora) if args.corpora else shared_corpora_dir()
        if corpora is None:
            raise ValueError("--corpora given but no corpora folder found (../shared/corpora or $AUTOTUNE_CORPORA)")
    family = FamilySpec(seed=args.seed).scaled(args.scale)
    report = train_family(Path(args.out), family, corpora=corpora)
    print(json.dumps({k: v for k, v in report.items() if k != "family"}, indent=2))


def cmd_zoo_train_head(args) -> None:
    from dataclasses import replace

    from autotune.data.corpus import shared_corpora_dir
    from autotune.train.head_training import HeadSpec, train_head

    spec = HeadSpec(seed=args.seed, domain=args.domain)
    spec = replace(spec, steps=max(1, int(spec.steps * args.scale)))
    report = train_head(Path(args.family) if args.family else None, spec,
                        out=Path(args.out) if args.out else None, corpora=shared_corpora_dir())
    print(json.dumps(report, indent=2))


def cmd_zoo_train_drafter(args) -> None:
    from autotune.data.corpus import shared_corpora_dir
    from autotune.train.zoo import train_drafter

    report = train_drafter(Path(args.family) if args.family else None, args.name, args.domain,
                           corpora=shared_corpora_dir(), steps=args.steps)
    print(json.dumps(report, indent=2))


def register(sub, common) -> None:
    p = sub.add_parser("llamacpp", help="build llama-server from llama-cpp-python's sdist and convert the family"
                                        " to GGUF (for --backend llamacpp and bench backends)")
    p.add_argument("--family", help="model family folder (default: the built-in family)")
    p.add_argument("--llamacpp-dir", metavar="DIR", help="where (default: $AUTOTUNE_LLAMACPP_DIR or ~/.cache/autotune)")
    p.set_defaults(func=cmd_llamacpp)

    zoo = sub.add_parser("zoo", help="the model family").add_subparsers(dest="zoo_command", required=True)
    p = zoo.add_parser("train", help="train the tokenizer and model family")
    p.add_argument("--out", required=True, help="folder to write the family to")
    p.add_argument("--corpora", nargs="?", const="", help="add ../shared/corpora (or this folder) to training")
    p.add_argument("--scale", type=at_least(0.001, float), default=1.0, help="scale every member's training steps")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_zoo_train)
    p = zoo.add_parser("train-head", help="train a feature (EAGLE-style) head for a family's target")
    p.add_argument("--family", help="model family folder (default: the built-in family)")
    p.add_argument("--out", help="folder to write the head to (default: FAMILY/feature, added to the family)")
    p.add_argument("--domain", choices=DOMAINS, default="code",
                   help="text to train on: code (stdlib), prose (../shared/corpora) or all (default: code)")
    p.add_argument("--scale", type=at_least(0.001, float), default=1.0, help="scale the training steps")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_zoo_train_head)
    p = zoo.add_parser("train-drafter", help="distil a one-layer drafter from a family's target on one domain")
    p.add_argument("name", help="the drafter's name and folder in the family (e.g. distilled-prose)")
    p.add_argument("--domain", choices=DOMAINS, required=True,
                   help="text to distil on: code (stdlib), prose (../shared/corpora) or all")
    p.add_argument("--family", help="model family folder (default: the built-in family)")
    p.add_argument("--steps", type=at_least(1), help="training steps (default: the recipe's distilled member's)")
    p.set_defaults(func=cmd_zoo_train_drafter)
