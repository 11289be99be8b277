"""A user's own requests as request classes: a JSONL file, one request a line.

Each line is a JSON object with `class` (the label the controller learns under) and `prompt`,
and optionally `temperature`, `top_p` and `max_new_tokens`. The controller learns per class, so a
class's lines share their sampling options; a line that differs from its class's first line, or
that is not such an object, is refused with its line number.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from autotune.data.classes import RequestClass

OPTIONS = {"temperature": 0.0, "top_p": 1.0, "max_new_tokens": 64}


class RequestsFileError(ValueError):
    """A requests file that cannot be read as requests; the message names the line."""


def _option(name: str, value, where: str):
    if name == "max_new_tokens":
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise RequestsFileError(f"{where}: max_new_tokens must be a whole number >= 1, got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestsFileError(f"{where}: {name} must be a number, got {value!r}")
    if name == "temperature" and value < 0:
        raise RequestsFileError(f"{where}: temperature must be >= 0, got {value!r}")
    if name == "top_p" and not 0 < value <= 1:
        raise RequestsFileError(f"{where}: top_p must be in (0, 1], got {value!r}")
    return float(value)


def read_requests(path: str | Path) -> dict[str, RequestClass]:
    """The request classes of a JSONL requests file, in the order their classes first appear."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise RequestsFileError(f"cannot read requests file {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise RequestsFileError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    prompts: dict[str, list[str]] = {}
    options: dict[str, tuple[dict, int]] = {}  # class -> (its options, the line that set them)
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}, line {number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise RequestsFileError(f"{where}: not JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise RequestsFileError(f"{where}: expected an object with 'class' and 'prompt', got {type(row).__name__}")
        if unknown := sorted(set(row) - {"class", "prompt", *OPTIONS}):
            raise RequestsFileError(f"{where}: unknown field(s) {unknown}; a line takes class, prompt and"
                                    f" {', '.join(OPTIONS)}")
        label, prompt = row.get("class"), row.get("prompt")
        if not isinstance(label, str) or not label.strip():
            raise RequestsFileError(f"{where}: 'class' must be a non-empty string, got {label!r}")
        if not isinstance(prompt, str) or not prompt:
            raise RequestsFileError(f"{where}: 'prompt' must be a non-empty string, got {prompt!r}")
        chosen = {name: _option(name, row.get(name, default), where) for name, default in OPTIONS.items()}
        first = options.setdefault(label, (chosen, number))
        if first[0] != chosen:
            raise RequestsFileError(f"{where}: class {label!r} has sampling options {chosen} here but {first[0]}"
                                    f" on line {first[1]}; one class, one set of options")
        prompts.setdefault(label, []).append(prompt)
    if not prompts:
        raise RequestsFileError(f"{path}: no requests (one JSON object a line: class, prompt)")
    return {label: RequestClass(label, f"{len(texts)} requests from {path.name}", tuple(texts), **options[label][0])
            for label, texts in prompts.items()}
