"""`autotune bench backends`: the controller on llama.cpp against every static setting, and this
project's engine against llama.cpp.

Two parts, each side by side in one run:
- **peer**: the same prompts, greedy, on llama.cpp OFF and on this engine OFF, eager and
  compiled, taking turns; tokens per second of each engine's own time (prefill and decode:
  llama.cpp's `timings`, the engine's `total_s`), and whether the outputs are the same tokens.
- **controller**: a stream of requests of several classes; every request is served by each
  static setting (OFF, every draft model at every K, the n-gram servers) and by the controller
  (policy over those arms), taking turns in rotating order. Each configuration's goodput is its
  output tokens over llama.cpp's own time for them; the per-class oracle serves each class on the
  static arm that was fastest on it in hindsight. Ratios count from after the first 20 % of the
  stream (what was learned by then) and from the first request. Greedy outputs of every
  speculative setting are compared with llama.cpp's own OFF outputs: the same, cut short, or
  differing in a token.
Prompt caching is off and the draft models' servers forget the last request before each turn
(`LlamaCppBackend.forget`): every configuration meets every prompt as the first to see it would.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass

from autotune.backends.base import BackendRequest, BackendResponse
from autotune.backends.controller import BackendController
from autotune.bench.common import rotate
from autotune.bench.tenants import tenant_stream
from autotune.data.classes import Request, RequestClass
from engine import OFF, Arm, SpeculativeEngine

WARM_FRACTION = 0.2


@dataclass
class Served:
    """One request on one configuration: its tokens and llama.cpp's time for them."""

    request: int
    request_class: str
    arm: str
    tokens: list[int]
    seconds: float


def server_seconds(response: BackendResponse) -> float:
    return response.prefill_s + response.decode_s


def bench_peer(backend, engines: dict[str, SpeculativeEngine], prompts: list[list[int]],
               max_new_tokens: int = 64) -> dict:
    """llama.cpp OFF against each of `engines` ({"eager": ..., "compiled": ...}) OFF, greedy,
    the same token ids, taking turns."""
    seconds, tokens = defaultdict(float), defaultdict(int)
    same = defaultdict(int)
    methods = ["llamacpp", *engines]
    for engine in engines.values():  # first calls allocate (and a compiled engine compiles)
        engine.generate(prompts[0], OFF, 8)
    backend.serve(BackendRequest(prompts[0], 8), OFF)
    for i, ids in enumerate(prompts):
        outputs = {}
        for method in rotate(methods, i):
            if method == "llamacpp":
                response = backend.serve(BackendRequest(ids, max_new_tokens), OFF)
                outputs[method], taken = response.tokens, server_seconds(response)
            else:
                result = engines[method].generate(ids, OFF, max_new_tokens)
                outputs[method], taken = result.tokens, result.metrics.total_s
            seconds[method] += taken
            tokens[method] += len(outputs[method])
        for method in engines:
            same[method] += outputs[method] == outputs["llamacpp"]
    rate = {m: tokens[m] / seconds[m] for m in methods}
    return {
        "prompts": len(prompts), "max_new_tokens": max_new_tokens,
        "tokens_per_s": {m: round(r, 1) for m, r in rate.items()},
        "ratio_vs_llamacpp": {m: round(rate[m] / rate["llamacpp"], 3) for m in engines},
        "same_tokens_as_llamacpp": dict(same),
    }


def bench_backend_controller(backend, classes: dict[str, RequestClass], tokenizer, per_class: int,
                             static_arms: list[Arm], policies: list[str], seed: int = 0) -> dict:
    """Every request of a stream on each static arm and each policy's controller, taking turns."""
    stream = tenant_stream(classes, per_class, seed)
    controllers = {p: BackendController(backend, policy=p, arms=static_arms, tokenizer=tokenizer) for p in policies}
    configs = [str(a) for a in static_arms] + [f"policy:{p}" for p in policies]
    served: dict[str, list[Served]] = defaultdict(list)
    overhead = defaultdict(float)  # the controller's own time: deciding and learning
    chosen: dict[str, dict[str, dict[str, int]]] = {p: defaultdict(lambda: defaultdict(int)) for p in policies}
    for i, request in enumerate(stream):
        ids = tokenizer.encode(request.prompt)
        for config in rotate(configs, i):
            backend.forget()  # every configuration meets the prompt as the first would
            if config.startswith("policy:"):
                policy = config.split(":", 1)[1]
                started = time.perf_counter()
                result = controllers[policy].generate(ids, request.request_class, request.max_new_tokens,
                                                      request.temperature, request.top_p, request.seed)
                wall = time.perf_counter() - started
                overhead[policy] += wall - result.response.total_s
                chosen[policy][request.request_class][str(result.arm)] += 1
                response = result.response
            else:
                response = backend.serve(_backend_request(request, ids), Arm.of(config))
            served[config].append(Served(i, request.request_class, config, response.tokens,
                                         server_seconds(response)))
    return _report(stream, served, static_arms, policies, overhead, chosen)


def _backend_request(request: Request, ids: list[int]) -> BackendRequest:
    return BackendRequest(ids, request.max_new_tokens, request.temperature, request.top_p, request.seed)


def _goodput(rows: list[Served]) -> float:
    return sum(len(r.tokens) for r in rows) / sum(r.seconds for r in rows)


def _report(stream: list[Request], served: dict[str, list[Served]], static_arms: list[Arm], policies: list[str],
            overhead: dict[str, float], chosen: dict) -> dict:
    statics = [str(a) for a in static_arms]
    warm = int(WARM_FRACTION * len(stream))
    per_class = defaultdict(dict)
    for config, rows in served.items():
        for name in {r.request_class for r in rows}:
            per_class[name][config] = _goodput([r for r in rows if r.request_class == name])
    best_arm = {name: max(statics, key=lambda a: rates[a]) for name, rates in per_class.items()}
    oracle = [row for rows in zip(*(served[a] for a in statics))
              for row in rows if row.arm == best_arm[row.request_class]]

    def after(rows: list[Served], start: int) -> list[Served]:
        return [r for r in rows if r.request >= start]

    best_static = max(statics, key=lambda a: _goodput(served[a]))
    out = {"requests": len(stream), "classes": len(per_class), "warm_fraction": WARM_FRACTION,
           "best_static": best_static, "best_arm_per_class": best_arm,
           "goodput": {c: round(_goodput(rows), 1) for c, rows in served.items()},
           "oracle_goodput": round(_goodput(oracle), 1),
           "oracle_vs_best_static": round(_goodput(oracle) / _goodput(served[best_static]), 3),
           "per_class_goodput": {n: {c: round(v, 1) for c, v in rates.items()} for n, rates in per_class.items()},
           "policies": {}}
    off = served[str(OFF)]
    for policy in policies:
        rows = served[f"policy:{policy}"]
        report = {}
        for label, start in (("after_warm", warm), ("from_first", 0)):
            mine = _goodput(after(rows, start))
            report[label] = {
                "ratio_vs_oracle": round(mine / _goodput(after(oracle, start)), 3),
                "ratio_vs_best_static": round(mine / _goodput(after(served[best_static], start)), 3),
                "ratio_vs_off": round(mine / _goodput(after(off, start)), 3),
                "worst_class_vs_off": round(min(
                    _goodput([r for r in after(rows, start) if r.request_class == n]) /
                    _goodput([r for r in after(off, start) if r.request_class == n]) for n in per_class), 3),
            }
        report["overhead_share"] = round(overhead[policy] / sum(r.seconds for r in rows), 4)
        report["arms_chosen"] = {n: dict(c) for n, c in chosen[policy].items()}
        out["policies"][policy] = report
    greedy = {i for i, r in enumerate(stream) if r.temperature == 0}
    off_tokens = {r.request: r.tokens for r in off}
    out["greedy_requests"] = len(greedy)
    out["greedy_vs_off"] = {c: _compare([(r.tokens, off_tokens[r.request]) for r in rows if r.request in greedy])
                            for c, rows in served.items() if c != str(OFF)}
    return out


def _compare(pairs: list[tuple[list[int], list[int]]]) -> dict[str, int]:
    """Greedy outputs against OFF's: the same, cut short (a prefix of OFF's: fewer tokens
    delivered, see llamacpp.py), or differing in a token."""
    out = {"same": 0, "cut_short": 0, "differ": 0}
    for tokens, reference in pairs:
        if tokens == reference:
            out["same"] += 1
        elif reference[:len(tokens)] == tokens:
            out["cut_short"] += 1
        else:
            out["differ"] += 1
    return out
