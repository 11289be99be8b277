"""Text sources: the Python standard library (on every machine) and, when present,
the public corpora in ../shared/corpora. Every source is split deterministically into a
training part and a held-out part, so request prompts never come from training text.
"""

from __future__ import annotations

import json
import os
import sysconfig
import zlib
from functools import lru_cache
from pathlib import Path

# What a drafter can be trained on (autotune.zoo.domain_texts): the standard library's code, the
# shared corpora's prose, or both.
DOMAINS = ("code", "prose", "all")
SKIP_DIRS = {"site-packages", "test", "tests", "idlelib", "__pycache__", "lib2to3"}


def is_held_out(key: str, percent: int = 10) -> bool:
    """Stable split by content key (a path or a text), independent of ordering and Python hash seed."""
    return zlib.crc32(key.encode("utf-8", "replace")) % 100 < percent


@lru_cache(maxsize=1)
def stdlib_files() -> tuple[tuple[str, str], ...]:
    """(relative path, source) of the interpreter's own .py files, sorted for reproducibility."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if SKIP_DIRS.intersection(path.relative_to(root).parts):
            continue
        try:
            out.append((rel, path.read_text(encoding="utf-8")))
        except (UnicodeDecodeError, OSError):
            continue
    return tuple(out)


def stdlib_texts(held_out: bool) -> list[str]:
    return [text for rel, text in stdlib_files() if is_held_out(rel) == held_out]


def shared_corpora_dir() -> Path | None:
    """../shared/corpora beside the project, or $AUTOTUNE_CORPORA; None when absent."""
    env = os.environ.get("AUTOTUNE_CORPORA")
    candidates = [Path(env)] if env else []
    candidates.append(Path(__file__).resolve().parents[2] / "shared" / "corpora")
    candidates.append(Path.cwd().parent / "shared" / "corpora")
    for c in candidates:
        if c.is_dir() and (c / "SOURCES.md").exists():
            return c
    return None


def read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def read_json(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def shingles(text: str, words: int = 12) -> set[int]:
    """Every run of `words` words in a text, hashed: t0 rows under other templates show the same
    passage, with other words around it, in the prompt or in the completion."""
    tokens = text.split()
    return {hash(tuple(tokens[i:i + words])) for i in range(len(tokens) - words + 1)}


def shared_training_texts(corpora: Path, held_out: bool = False) -> list[str]:
    """Prose, maths, chat and creative text from the shared corpora: their training parts, or
    with `held_out` the parts kept from training."""
    texts = []
    rows = read_jsonl(corpora / "t0_prose.jsonl")
    # The prose classes draw held-out rows; other rows show the same passage under another
    # template (as prompt, or as the completion asked for), so those stay out of training too.
    t0 = [row["prompt"] + row["completion"] for row in rows]
    if held_out:
        texts += [text for text in t0 if is_held_out(text)]
    else:
        shown = set().union(*(shingles(text) for text in t0 if is_held_out(text)))
        texts += [text for text in t0 if shown.isdisjoint(shingles(text))]
    for row in read_jsonl(corpora / ("gsm8k_test.jsonl" if held_out else "gsm8k_train.jsonl")):
        texts.append(f"Question: {row['question']}\nAnswer: {row['answer']}")
    for name in ("gpteacher_roleplay.json", "gpteacher_toolformer.json"):
        for row in read_json(corpora / name):
            # split by instruction, as the chat and structured classes draw their prompts
            if is_held_out(row["instruction"]) == held_out:
                texts.append(f"{row['instruction']}\n{row.get('input', '')}\n{row['response']}")
    shakespeare = (corpora / "tinyshakespeare.txt").read_text(encoding="utf-8")
    split = int(len(shakespeare) * 0.9)
    texts.append(shakespeare[split:] if held_out else shakespeare[:split])
    return texts
