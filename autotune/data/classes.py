"""Request classes and mixed workloads.

A request class is a name, a prompt source, sampling parameters and a max length. The
built-in classes come from held-out standard-library source, so every machine has them;
the classes from ../shared/corpora appear only when that folder exists. Prompts are drawn
deterministically and never from the text the model family was trained on.
"""

from __future__ import annotations

import ast
import random
import re
from dataclasses import dataclass, field
from functools import lru_cache

from autotune.data.corpus import is_held_out, read_json, read_jsonl, shared_corpora_dir, stdlib_files

PROMPTS_PER_CLASS = 64


@dataclass(frozen=True)
class RequestClass:
    name: str
    description: str
    prompts: tuple[str, ...]
    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = 64


@dataclass(frozen=True)
class Request:
    request_class: str
    prompt: str
    temperature: float
    top_p: float
    max_new_tokens: int
    seed: int


def stdlib_functions(held_out: bool = True) -> list[tuple[str, str, ast.FunctionDef]]:
    """(path, source, function node) of every function in held-out (or training) files, in path order."""
    out = []
    for rel, source in stdlib_files():
        if is_held_out(rel) != held_out:
            continue
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno:
                out.append((rel, source, node))
    out.sort(key=lambda item: (item[0], item[2].lineno))
    return out


def _sample(items: list, n: int, seed: int) -> list:
    rng = random.Random(seed)
    return rng.sample(items, min(n, len(items)))


def _code_prompts(n: int) -> list[str]:
    """The first part of a held-out function (signature, docstring, a few lines) to complete.

    Prompts stop before a line break, never just after it: byte-level BPE merges a line break
    with the next line's indentation, so a prompt ending in a bare line break ends on a token
    the model has only seen before unindented text, and it would start a new definition.
    """
    prompts = []
    for _, source, node in stdlib_functions():
        lines = source.splitlines()[node.lineno - 1 : node.end_lineno]
        if 8 <= len(lines) <= 60:
            cut = max(2, len(lines) // 3)
            prompts.append("\n".join(lines[:cut]))
    return _sample(prompts, n, seed=1)


def _docs_prompts(n: int) -> list[str]:
    """Code followed by the opening of a docstring or comment block: English-like continuation."""
    prompts = []
    for _, source, node in stdlib_functions():
        doc = ast.get_docstring(node, clean=False)
        if doc and len(doc) > 120 and node.body:
            lines = source.splitlines()
            head = "\n".join(lines[node.lineno - 1 : node.body[0].lineno - 1])
            first = lines[node.body[0].lineno - 1]
            indent = first[: len(first) - len(first.lstrip())]
            words = doc.strip().split()[:4]
            prompts.append(f'{head}\n{indent}"""{" ".join(words)}')
    return _sample(prompts, n, seed=2)


def edit_example(source: str, node: ast.FunctionDef) -> tuple[str, str] | None:
    """(instruction with the original function, the function with one argument renamed).

    The edit class prompts with the instruction and the renamed first line; the model family
    also trains on such pairs from training files, so the target learns to copy.
    """
    lines = source.splitlines()[node.lineno - 1 : node.end_lineno]
    if not 6 <= len(lines) <= 30:
        return None
    names = sorted({a.arg for a in node.args.args if a.arg != "self" and len(a.arg) > 2})
    if not names:
        return None
    body = "\n".join(lines)
    old = names[0]
    new = f"{old}_value" if not old.endswith("_value") else f"new_{old}"
    edited = re.sub(rf"\b{re.escape(old)}\b", new, body)
    return f"# Original:\n{body}\n\n# The same function with {old} renamed to {new}:\n", edited


def _edit_prompts(n: int) -> list[str]:
    """Code to reproduce with one identifier renamed: output copies from the prompt.

    Like code prompts, they stop before the line break that ends the copy's first line."""
    prompts = []
    for _, source, node in stdlib_functions():
        example = edit_example(source, node)
        if example is not None:
            instruction, edited = example
            prompts.append(instruction + edited.splitlines()[0])
    return _sample(prompts, n, seed=3)


def _creative_prompts(n: int) -> list[str]:
    """Openings of held-out modules, continued by sampling at temperature 1.0."""
    prompts = []
    for rel, source in stdlib_files():
        if is_held_out(rel) and len(source) > 800:
            start = source.find("\n", len(source) // 3) + 1
            prompts.append(source[start : start + 400])
    return _sample(prompts, n, seed=4)


def _shared_classes(n: int) -> list[RequestClass]:
    corpora = shared_corpora_dir()
    if corpora is None:
        return []
    classes = []
    math = read_jsonl(corpora / "gsm8k_test.jsonl")
    classes.append(RequestClass(
        "math", "GSM8K word problems (test split), greedy",
        tuple(f"Question: {r['question']}\nAnswer:" for r in _sample(math, n, 5)),
    ))
    prose = [r for r in read_jsonl(corpora / "t0_prose.jsonl") if is_held_out(r["prompt"] + r["completion"])]
    summarize = [r["prompt"] for r in prose if re.search(r"summar|highlights|TL;DR", r["prompt"], re.I)]
    qa = [r["prompt"] for r in prose if re.search(r"question|answer", r["prompt"], re.I)]
    classes.append(RequestClass("summarize", "t0 news summarization prompts, greedy",
                                tuple(p[-1500:] for p in _sample(summarize, n, 6))))
    classes.append(RequestClass("qa", "t0 reading-comprehension QA prompts, greedy",
                                tuple(p[-1500:] for p in _sample(qa, n, 7))))
    chat = [turns["turns"][0] for turns in read_jsonl(corpora / "mt_bench_questions.jsonl")]
    chat += [r["instruction"] for r in read_json(corpora / "gpteacher_roleplay.json") if is_held_out(r["instruction"])]
    classes.append(RequestClass("chat", "MT-Bench and role-play instructions, sampled at 0.7",
                                tuple(f"User: {t}\nAssistant:" for t in _sample(chat, n, 8)),
                                temperature=0.7, top_p=0.9))
    tools = [r for r in read_json(corpora / "gpteacher_toolformer.json") if is_held_out(r["instruction"])]
    classes.append(RequestClass("structured", "instructions answered with tool-call markup, greedy",
                                tuple(f"{r['instruction']}\n{r.get('input', '')}\n"[-1500:]
                                      for r in _sample(tools, n, 9))))
    return classes


@lru_cache(maxsize=4)
def builtin_classes(include_shared: bool = True, n: int = PROMPTS_PER_CLASS) -> dict[str, RequestClass]:
    classes = [
        RequestClass("code", "greedy completion of held-out stdlib functions", tuple(_code_prompts(n))),
        RequestClass("docs", "docstrings: English-like text inside code, greedy", tuple(_docs_prompts(n))),
        RequestClass("edit", "reproduce a function with one name changed (copying)", tuple(_edit_prompts(n))),
        RequestClass("creative", "continue a module by sampling at temperature 1.0", tuple(_creative_prompts(n)),
                     temperature=1.0),
    ]
    if include_shared:
        classes += _shared_classes(n)
    return {c.name: c for c in classes}


@dataclass(frozen=True)
class Workload:
    """A stream of requests drawn from classes with weights; `drift` swaps weights mid-stream.

    drift: ((fraction, weights), ...): from that fraction of the stream on, use those weights.
    burst_share: the share of arrivals that are a burst of `burst_size` requests of one class
    arriving together (served as one batch: the load case); the rest arrive alone.
    """

    weights: dict[str, float]
    n_requests: int = 200
    seed: int = 0
    drift: tuple[tuple[float, dict[str, float]], ...] = field(default_factory=tuple)
    burst_share: float = 0.0
    burst_size: int = 16

    def stream(self, classes: dict[str, RequestClass]) -> list[list[Request]]:
        """Arrivals in order: each a list of one request, or of `burst_size` for a burst."""
        rng = random.Random(self.seed + 1_000_003)
        out = []
        for first in self.requests(classes):
            if self.burst_share > 0 and rng.random() < self.burst_share:
                cls = classes[first.request_class]
                out.append([first] + [Request(cls.name, prompt, cls.temperature, cls.top_p, cls.max_new_tokens,
                                              seed=rng.randrange(2**31))
                                      for prompt in rng.sample(cls.prompts, self.burst_size - 1)])
            else:
                out.append([first])
        return out

    def requests(self, classes: dict[str, RequestClass]) -> list[Request]:
        for name in {*self.weights, *(n for _, w in self.drift for n in w)}:
            if name not in classes:
                raise KeyError(f"workload names unknown request class {name!r}; known: {sorted(classes)}")
        rng = random.Random(self.seed)
        out = []
        for i in range(self.n_requests):
            weights = self.weights
            for fraction, w in self.drift:
                if i >= fraction * self.n_requests:
                    weights = w
            names = [n for n, w in weights.items() if w > 0]
            name = rng.choices(names, [weights[n] for n in names])[0]
            cls = classes[name]
            out.append(Request(name, rng.choice(cls.prompts), cls.temperature, cls.top_p, cls.max_new_tokens,
                               seed=rng.randrange(2**31)))
        return out
