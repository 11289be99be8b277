"""Benchmarks. Every ratio is measured side by side in one run: the compared methods take
turns on the same prompts, in rotating order, so a slow moment of a shared machine hits
them all alike. Nothing here asserts speed; the numbers go to a table and to JSON.
"""

from __future__ import annotations

import contextlib
import copy
import math
import statistics
import threading
import time
from collections import defaultdict
from pathlib import Path
from unittest import mock

import torch
from transformers import DynamicCache

import engine.batch as engine_batch
import engine.runner as engine_runner
from autotune.classes import Request, RequestClass, Workload
from autotune.controller import AutotuneController, default_arms
from autotune.counterfactual import CostModel, arm_rewards
from engine import OFF, Arm, HybridDrafter, ModelDrafter, NGramDrafter, SamplingParams, SpeculativeEngine
from engine.kvcache import GrowingCache
from policies import Context, Policy, make_policy
from store import Store

BENCH_KS = (1, 2, 3, 4, 6, 8)


def _rotate(items: list, i: int) -> list:
    i %= len(items)
    return items[i:] + items[:i]


def device_name(engine: SpeculativeEngine) -> str:
    if engine.device.type == "cuda":
        return torch.cuda.get_device_name(engine.device)
    return f"cpu ({torch.get_num_threads()} threads)"


# ----- bench engine --------------------------------------------------------------------------
def _hf_generate(engine: SpeculativeEngine, ids: list[int], max_new_tokens: int, arm: Arm | None):
    inputs = torch.tensor([ids], device=engine.device)
    kwargs = dict(attention_mask=torch.ones_like(inputs), do_sample=False, max_new_tokens=max_new_tokens,
                  pad_token_id=min(engine.eos_token_id, default=0))
    if arm is not None:
        drafter = engine.drafters[arm.drafter]
        if isinstance(drafter, NGramDrafter):
            kwargs.update(prompt_lookup_num_tokens=arm.k)
        elif not isinstance(drafter, ModelDrafter):
            raise ValueError(f"transformers has no counterpart of drafter {arm.drafter!r} to compare with")
        else:
            kwargs.update(assistant_model=drafter.model, num_assistant_tokens=arm.k,
                          num_assistant_tokens_schedule="constant", assistant_confidence_threshold=0.0)
    with torch.inference_mode():
        engine._sync()
        start = time.perf_counter()
        out = engine.target.generate(inputs, **kwargs)
        seconds = engine._sync() - start
    return out[0, len(ids):].tolist(), seconds


def _compile_total(report: dict[str, dict[str, float]]) -> float:
    return round(sum(t for graphs in report.values() for t in graphs.values()), 2)


def eager_twin(engine: SpeculativeEngine) -> SpeculativeEngine:
    """The same models on the default eager path, to measure a compiled engine against."""
    def twin(d):  # a drafter of its own: add_drafter gives a model drafter the twin's runner
        if isinstance(d, HybridDrafter):
            return HybridDrafter(d.model_drafter.model, d.lookup.max_ngram, d.lookup.min_ngram)
        return d.model if isinstance(d, ModelDrafter) else d

    drafters = {n: twin(d) for n, d in engine.drafters.items()}
    return SpeculativeEngine(engine.target, drafters, engine.tokenizer, engine.device, engine.dtype, compile=False)


def bench_engine(engine: SpeculativeEngine, prompts: list[str], arm: Arm, max_new_tokens: int = 64) -> dict:
    """Engine OFF vs `generate()`, engine on `arm` vs transformers assisted generation.

    A compiled engine is also measured against its eager twin (same models), side by side, and
    its one-time compile cost is reported; compiling happens before any timing.
    """
    encoded = [engine.encode(p).tolist() for p in prompts]
    totals = defaultdict(float)
    tokens = defaultdict(int)
    identical = True
    spec_metrics = []
    off_metrics = []
    methods = ["hf_generate", "engine_off", "hf_assisted", "engine_spec"]
    engines = {"engine": engine}
    compile_report = None
    if engine.cache_kind == "compiled":
        compile_report = engine.warm_up([OFF, arm])
        engines["eager"] = eager_twin(engine)
        methods += ["eager_off", "eager_spec"]
    warm = encoded[0]  # first calls allocate and pick kernels: keep them out of the timings
    _hf_generate(engine, warm, 8, None)
    _hf_generate(engine, warm, 8, arm)
    for e in engines.values():
        e.generate(warm, OFF, 8)
        e.generate(warm, arm, 8)
    for i, ids in enumerate(encoded):
        outputs = {}
        for method in _rotate(methods, i):
            if method.startswith("hf"):
                out, seconds = _hf_generate(engine, ids, max_new_tokens, arm if method == "hf_assisted" else None)
            else:
                which, what = method.split("_")
                result = engines[which].generate(ids, OFF if what == "off" else arm, max_new_tokens)
                out, seconds = result.tokens, result.metrics.total_s
                if which == "engine":
                    (off_metrics if what == "off" else spec_metrics).append(result.metrics)
            outputs[method] = out
            totals[method] += seconds
            tokens[method] += len(out)
        identical &= all(o == outputs["hf_generate"] for o in outputs.values())
    tps = {m: tokens[m] / totals[m] for m in methods}
    drafted = sum(m.drafted for m in spec_metrics)
    a = sum(m.accepted for m in spec_metrics) / drafted if drafted else 0.0
    off_step = sum(m.verify_s for m in off_metrics) / sum(m.rounds for m in off_metrics)
    c = (sum(m.draft_s for m in spec_metrics) / drafted) / off_step if drafted else 0.0
    speedup = tps["engine_spec"] / tps["engine_off"]
    k = arm.k
    expected = (1 - a ** (k + 1)) / ((1 - a) * (c * k + 1)) if a < 1 else (k + 1) / (c * k + 1)
    result = {
        "device": device_name(engine),
        "cache": engine.cache_kind,
        "arm": str(arm),
        "prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "tokens_per_s": {m: round(v, 2) for m, v in tps.items()},
        "ratio_off_vs_hf_generate": round(tps["engine_off"] / tps["hf_generate"], 3),
        "ratio_spec_vs_hf_assisted": round(tps["engine_spec"] / tps["hf_assisted"], 3),
        "speedup_vs_off": round(speedup, 3),
        "off_step_ms": round(off_step * 1000, 3),
        "acceptance": round(a, 4),
        "cost_ratio": round(c, 4),
        "bound_ratio": round(speedup / expected, 3) if expected > 0 else None,
        "identical_outputs": identical,
    }
    if compile_report is not None:
        result["ratio_off_vs_eager_off"] = round(tps["engine_off"] / tps["eager_off"], 3)
        result["ratio_spec_vs_eager_spec"] = round(tps["engine_spec"] / tps["eager_spec"], 3)
        result["compile_s"] = {m: {g: round(t, 2) for g, t in r.items()} for m, r in compile_report.items()}
        result["compile_s_total"] = _compile_total(compile_report)
    return result


# ----- bench lossless ------------------------------------------------------------------------
def _float32_gap(reference: torch.nn.Module, ids: list[int], a: int, b: int) -> float:
    """|logit(a) - logit(b)| of the float32 target after `ids`: how close to a tie the choice was."""
    with torch.inference_mode():
        x = torch.tensor([ids], device=next(reference.parameters()).device)
        logits = reference(x).logits[0, -1].float()
    return round(float((logits[a] - logits[b]).abs()), 4)


def bench_lossless(engine: SpeculativeEngine, classes: dict[str, RequestClass], arms: list[Arm],
                   prompts_per_class: int = 4, max_new_tokens: int = 64) -> dict:
    """Greedy output of every arm against the target's own greedy `generate()`, request by request.

    In float32 every output must be identical. In bfloat16 a (K+1)-token verify and a 1-token
    step round differently, so a near-tie can go the other way; each divergence is reported
    with the float32 target's logit gap between the two tokens, which tells rounding (a gap of
    a few hundredths) from a broken engine (a gap the size of a real preference).
    """
    reference = engine.target if engine.dtype == torch.float32 else copy.deepcopy(engine.target).float()
    engine.warm_up([OFF, *arms])
    requests = identical = off_identical = 0
    divergences = []
    for name, cls in classes.items():
        for prompt in cls.prompts[:prompts_per_class]:
            ids = engine.encode(prompt).tolist()
            own, _ = _hf_generate(engine, ids, max_new_tokens, None)
            off_identical += engine.generate(ids, OFF, max_new_tokens).tokens == own
            for arm in arms:
                out = engine.generate(ids, arm, max_new_tokens).tokens
                requests += 1
                identical += out == own
                if out != own:
                    common = min(len(out), len(own))
                    at = next((i for i, (x, y) in enumerate(zip(out, own)) if x != y), common)
                    gap = _float32_gap(reference, ids + own[:at], own[at], out[at]) if at < common else None
                    divergences.append({"class": name, "arm": str(arm), "position": at, "float32_gap": gap})
    gaps = [d["float32_gap"] for d in divergences if d["float32_gap"] is not None]
    return {"device": device_name(engine), "dtype": str(engine.dtype).split(".")[-1], "cache": engine.cache_kind,
            "arms": [str(a) for a in arms], "max_new_tokens": max_new_tokens, "requests": requests,
            "identical": identical, "engine_off_identical": off_identical,
            "engine_off_requests": requests // max(len(arms), 1), "max_float32_gap": max(gaps, default=None),
            "divergences": divergences}


# ----- bench cache ---------------------------------------------------------------------------
@contextlib.contextmanager
def _eager_cache(cache_class):
    """Serve with `cache_class(config)` as the eager KV cache of single requests and batches."""
    with mock.patch.object(engine_runner, "GrowingCache", cache_class), \
            mock.patch.object(engine_batch, "GrowingCache", cache_class):
        yield


def bench_cache(engine: SpeculativeEngine, classes: dict[str, RequestClass],
                cases: list[tuple[int, str, Arm, int]]) -> dict:
    """The engine's eager KV cache (GrowingCache) against transformers' DynamicCache, which copies
    the whole cache into a new tensor every step. Each case (batch size, class, arm, repeats)
    serves `repeats` batches (size 1: single requests; different prompts while the class has
    them) with both caches, taking turns; outputs must be identical."""
    caches = {"dynamic": lambda config: DynamicCache(config=config), "growing": GrowingCache}
    out, identical = {}, True
    for size, name, arm, repeats in cases:
        cls = classes[name]
        seconds, tokens = dict.fromkeys(caches, 0.0), dict.fromkeys(caches, 0)
        for i in range(repeats):
            start = i * size % max(1, len(cls.prompts) - size + 1)  # the class's prompts again once used up
            prompts = [engine.encode(p).tolist() for p in cls.prompts[start:start + size]]
            sampling = [SamplingParams(cls.temperature, cls.top_p, seed=j) for j in range(size)]
            outputs = []
            for cache in _rotate(list(caches), i):
                with _eager_cache(caches[cache]):
                    began = time.perf_counter()
                    if size == 1:  # the single-request path, which crops rejected drafts
                        served = [engine.generate(prompts[0], arm, cls.max_new_tokens, sampling[0])]
                    else:
                        served = engine.generate_batch(prompts, arm, cls.max_new_tokens, sampling).results
                    seconds[cache] += time.perf_counter() - began
                tokens[cache] += sum(r.metrics.new_tokens for r in served)
                outputs.append([r.tokens for r in served])
            identical &= outputs[0] == outputs[1]
        tps = {c: tokens[c] / seconds[c] for c in caches}
        out[f"batch {size} {name} {arm}"] = {"repeats": repeats,
                                             "tokens_per_s": {c: round(v, 1) for c, v in tps.items()},
                                             "growing_vs_dynamic": round(tps["growing"] / tps["dynamic"], 3)}
    return {"device": device_name(engine), "identical_outputs": identical, "cases": out}


# ----- bench arms ----------------------------------------------------------------------------
def loops(tokens: list[int], min_len: int = 24) -> bool:
    """The output ends in a short cycle (a weak model's 'import sys' repeated)."""
    for period in range(1, 17):
        span = max(min_len, 3 * period)
        if len(tokens) >= span and all(tokens[-i] == tokens[-i - period] for i in range(1, span - period + 1)):
            return True
    return False


def bench_arms(engine: SpeculativeEngine, classes: dict[str, RequestClass], arms: list[Arm],
               prompts_per_class: int = 6, max_new_tokens: int | None = None, batch: int = 1,
               progress=print) -> dict:
    """Every class on every arm, side by side; the ground truth the controller must learn.

    batch > 1 measures the load case: `prompts_per_class // 3` (at least 2) batches of a class's
    next `batch` prompts, each served together on every arm, arms taking turns.
    """
    out = {}
    compile_report = engine.warm_up(arms) if batch == 1 else {}
    warm = engine.encode(next(iter(classes.values())).prompts[0]).tolist()
    for arm in arms:
        engine.generate(warm, arm, 4)
    for name, cls in classes.items():
        stats = {str(a): defaultdict(float) for a in arms}
        loop_count = 0
        limit = max_new_tokens or cls.max_new_tokens
        if batch == 1:
            prompts = cls.prompts[:prompts_per_class]
            units = [[engine.encode(p).tolist()] for p in prompts]
        else:  # different batches: one batch's prompts are not the class
            prompts = cls.prompts[:batch * max(2, prompts_per_class // 3)]
            units = [[engine.encode(p).tolist() for p in prompts[i:i + batch]] for i in range(0, len(prompts), batch)]
        for i, unit in enumerate(units):
            for arm in _rotate(arms, i):
                sampling = [SamplingParams(cls.temperature, cls.top_p, seed=i * batch + j) for j in range(len(unit))]
                if batch == 1:
                    r = engine.generate(unit[0], arm, limit, sampling[0])
                    rows, m = [r], r.metrics
                else:
                    out_batch = engine.generate_batch(unit, arm, limit, sampling)
                    rows, m = out_batch.results, out_batch.metrics
                s = stats[str(arm)]
                s["tokens"] += m.new_tokens
                s["seconds"] += m.total_s
                s["drafted"] += m.drafted
                s["accepted"] += m.accepted
                s["rounds"] += sum(r.metrics.rounds for r in rows)
                s["requests"] += len(rows)
                if arm.is_off:
                    loop_count += sum(loops(r.tokens) for r in rows)
        off_tps = stats["off"]["tokens"] / stats["off"]["seconds"]
        arms_out = {}
        for arm, s in stats.items():
            tps = s["tokens"] / s["seconds"]
            arms_out[arm] = {
                "acceptance": round(s["accepted"] / s["drafted"], 4) if s["drafted"] else None,
                "mean_accepted": round((s["tokens"] - s["requests"]) / s["rounds"], 3) if s["rounds"] else None,
                "tokens_per_s": round(tps, 2),
                "speedup_vs_off": round(tps / off_tps, 3),
            }
        best = max(arms_out, key=lambda a: arms_out[a]["tokens_per_s"])
        out[name] = {"best_arm": best, "loop_rate": round(loop_count / len(prompts), 3), "arms": arms_out}
        speedup = arms_out[best]["speedup_vs_off"]
        progress(f"{name}: best {best} ({speedup}x vs off), loop rate {loop_count}/{len(prompts)}")
    return {"device": device_name(engine), "cache": engine.cache_kind, "prompts_per_class": prompts_per_class,
            "batch": batch, "compile_s_total": _compile_total(compile_report), "classes": out}


# ----- bench replay --------------------------------------------------------------------------
def bench_replay(engine: SpeculativeEngine, classes: dict[str, RequestClass], arms: list[Arm],
                 prompts_per_class: int = 6, progress=print) -> dict:
    """How well replaying one request (counterfactual.py) predicts every arm's reward.

    Every prompt is served on every arm, arms taking turns; each arm's measured reward is the
    controller's (the OFF time of this request's output over the time taken). The estimate is
    what the controller would have learned from the OFF request alone, at the costs measured
    over the whole class, so this measures the replay and the cost model, not the learning.
    """
    engine.warm_up(arms)
    out, errors = {}, []
    for name, cls in classes.items():
        costs = CostModel(discount=1.0)
        off = [0.0, 0.0]  # OFF decode [steps, seconds]
        served = []
        for i, prompt in enumerate(cls.prompts[:prompts_per_class]):
            ids = engine.encode(prompt).tolist()
            sampling = SamplingParams(cls.temperature, cls.top_p, seed=i)
            results = {}
            for arm in _rotate(arms, i):
                results[str(arm)] = r = engine.generate(ids, arm, cls.max_new_tokens, sampling)
                costs.observe(arm, r.metrics)
                if arm.is_off:
                    off[0] += r.metrics.rounds
                    off[1] += r.metrics.verify_s
            served.append((ids, sampling, results))
        step = off[1] / off[0]
        measured, estimated = defaultdict(list), defaultdict(list)
        for ids, sampling, results in served:
            for arm, r in results.items():
                m = r.metrics
                measured[arm].append((m.prefill_s + (m.new_tokens - 1) * step) / m.total_s)
            r = results["off"]
            estimates = arm_rewards(engine, arms, costs, [(ids, r.tokens, cls.max_new_tokens)], r.metrics.prefill_s,
                                    step, sampling)
            for arm, value in estimates.items():
                estimated[arm].append(value)
        rows = {}
        for arm in measured:
            rows[arm] = {"measured": round(statistics.fmean(measured[arm]), 3),
                         "estimated": round(statistics.fmean(estimated[arm]), 3)}
            errors.append(abs(rows[arm]["estimated"] - rows[arm]["measured"]))
        out[name] = rows
        worst = max(rows, key=lambda a: abs(rows[a]["estimated"] - rows[a]["measured"]))
        progress(f"{name}: worst {worst} measured {rows[worst]['measured']} estimated {rows[worst]['estimated']}")
    return {"device": device_name(engine), "cache": engine.cache_kind, "prompts_per_class": prompts_per_class,
            "mean_abs_error": round(statistics.fmean(errors), 4), "max_abs_error": round(max(errors), 4),
            "classes": out}


# ----- bench controller ----------------------------------------------------------------------
class OraclePolicy(Policy):
    """Hindsight: the ground-truth best arm of each class at each load (not available online)."""

    name = "oracle"

    def __init__(self, arms: list[Arm], best: dict[str, Arm]) -> None:
        super().__init__([*arms, *best.values()])
        self.best = best  # "class@load<bucket>" -> arm

    def choose(self, context: Context) -> Arm:
        return self.best.get(context.key, self.best.get(Context(context.request_class).key, OFF))


def _p99(values) -> float:
    ordered = sorted(values)
    return round(ordered[int(0.99 * (len(ordered) - 1))], 4)


def _goodput(rows: list[dict]) -> float:
    seconds = sum(r["seconds"] for r in rows)
    return sum(r["tokens"] for r in rows) / seconds if seconds else 0.0


def _cell(request_class: str, load: int) -> str:
    return Context(request_class, load).key


def _run_stream(engine, stream: list[list[Request]], controllers: dict[str, AutotuneController],
                restart: dict | None = None, progress=print) -> dict[str, list[dict]]:
    """Serve every arrival (a request, or a burst served as one batch) with every controller,
    rotating who goes first."""
    log = {name: [] for name in controllers}
    names = list(controllers)
    for i, item in enumerate(stream):
        if restart and i == restart["at"]:
            for name in restart["names"]:
                controllers[name] = restart["reopen"](name, controllers[name])
        req = item[0]
        for name in _rotate(names, i):
            ctl = controllers[name]
            if len(item) == 1:
                rs = [ctl.generate(req.prompt, req.request_class, req.max_new_tokens, req.temperature, req.top_p,
                                   req.seed)]
                seconds = rs[0].metrics.total_s
            else:
                rs = ctl.generate_batch([r.prompt for r in item], req.request_class, req.max_new_tokens,
                                        req.temperature, req.top_p, [r.seed for r in item])
                seconds = max(r.metrics.total_s for r in rs)  # the batch's wall time
            log[name].append({"class": req.request_class, "cell": _cell(req.request_class, len(item)),
                              "arm": str(rs[0].arm), "tokens": sum(r.metrics.new_tokens for r in rs),
                              "seconds": seconds + rs[0].decision_s + rs[0].learn_s,
                              "decision_ms": rs[0].decision_s * 1000})
        if (i + 1) % 20 == 0:
            progress(f"  {i + 1}/{len(stream)} arrivals")
    return log


def _summary(log: dict[str, list[dict]], warmup: float) -> dict:
    start = int(len(next(iter(log.values()))) * warmup)
    out = {}
    for name, rows in log.items():
        after = rows[start:]
        per_cell = defaultdict(list)
        for r in after:
            per_cell[r["cell"]].append(r)
        out[name] = {"goodput": round(_goodput(after), 2),
                     "per_class": {c: round(_goodput(rs), 2) for c, rs in sorted(per_cell.items())}}
    return out


def _cell_weights(ground_truth: dict[int, dict], workload: Workload) -> dict[tuple[int, str], float]:
    """(load, class) -> the cell's share of the stream's OFF time: its share of arrivals times the
    OFF seconds of one arrival there (per output token of each row)."""
    shares = {1: 1.0 - workload.burst_share}
    if workload.burst_share > 0:
        if workload.burst_size not in ground_truth:
            raise ValueError(f"the workload has bursts of {workload.burst_size} but the ground truth covers"
                             f" batches of {sorted(ground_truth)} only: run `bench arms --batch {workload.burst_size}`")
        shares[workload.burst_size] = workload.burst_share
    return {(size, c): workload.weights[c] * share * size / truth["arms"]["off"]["tokens_per_s"]
            for size, share in shares.items() for c, truth in ground_truth[size]["classes"].items()
            if c in workload.weights}


def hindsight_arms(ground_truth: dict[int, dict], workload: Workload) -> tuple[dict[str, Arm], Arm, float]:
    """The per-(class, load) oracle arms, the best single static arm for this workload, and how
    much faster the ground truth says the oracle is than that static arm.

    `ground_truth` maps a batch size (1: requests alone) to `bench arms` output. The static arm
    minimises the stream's expected time: each (class, load) cell weighs its share of the OFF
    time, divided by the arm's speedup in that cell. The expected gain is the most a controller
    choosing per class and load can have over the static arm (within-class choices aside).
    """
    weight = _cell_weights(ground_truth, workload)
    truth = {cell: ground_truth[cell[0]]["classes"][cell[1]] for cell in weight}

    def stream_time(arm_in) -> float:  # arm_in(cell) -> the arm played there
        return sum(w / truth[cell]["arms"][arm_in(cell)]["speedup_vs_off"] for cell, w in weight.items())

    candidates = set.intersection(*(set(t["arms"]) for t in truth.values()))
    static = min(sorted(candidates), key=lambda a: stream_time(lambda _: a))
    gain = stream_time(lambda _: static) / stream_time(lambda cell: truth[cell]["best_arm"])
    best = {_cell(c, size): Arm.parse(truth[(size, c)]["best_arm"]) for size, c in weight}
    return best, Arm.parse(static), round(gain, 3)


def bench_controller(engine: SpeculativeEngine, classes: dict[str, RequestClass], ground_truth: dict[int, dict],
                     workload: Workload, out_dir: Path, policies=("ucb", "thompson", "contextual"),
                     warmup: float = 0.2, drift: Workload | None = None, progress=print) -> dict:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    arms = default_arms(engine)
    best, static, expected_gain = hindsight_arms(ground_truth, workload)
    best_drafter = static.drafter or next(iter(engine.drafters))

    def controllers(tag: str, names) -> dict[str, AutotuneController]:
        built = {}
        for name in names:
            path = out_dir / f"{tag}-{name}.db"
            for stale in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
                stale.unlink(missing_ok=True)  # a previous run's store would resume what it learned
            store = Store(f"sqlite:///{path}", label=f"bench {tag} {name}")
            if name == "oracle":
                policy = OraclePolicy(arms, best)
            elif name == "static_best":
                policy = make_policy("static", arms, arm=static)
            elif name == "heuristic":
                policy = make_policy("heuristic", arms, arm=Arm(best_drafter, 5))
            else:
                policy = make_policy(name, arms)
            built[name] = AutotuneController(engine, store, policy=policy)
        return built

    def close(ctls):
        for c in ctls.values():
            c.close()
            c.store.close()

    stream = workload.stream(classes)
    bursts = sum(len(item) > 1 for item in stream)
    progress(f"stationary stream: {len(stream)} arrivals ({bursts} bursts of {workload.burst_size});"
             f" static best in hindsight {static}")
    main = controllers("main", [*policies, "static_best", "oracle", "off", "heuristic"])
    log = _run_stream(engine, stream, main, progress=progress)
    close(main)
    summary = _summary(log, warmup)
    lead = policies[0]
    ctl, oracle, off = summary[lead], summary["oracle"], summary["off"]
    result = {
        "device": device_name(engine),
        "requests": workload.n_requests,
        "bursts": bursts,
        "burst_size": workload.burst_size if bursts else None,
        "warmup_fraction": warmup,
        "policy": lead,
        "static_best_arm": str(static),
        "oracle_arms": {c: str(a) for c, a in best.items()},
        "ratio_vs_best_static": round(ctl["goodput"] / summary["static_best"]["goodput"], 3),
        "ratio_vs_oracle": round(ctl["goodput"] / oracle["goodput"], 3),
        "ratio_vs_off": round(ctl["goodput"] / off["goodput"], 3),
        "ratio_vs_heuristic": round(ctl["goodput"] / summary["heuristic"]["goodput"], 3),
        "oracle_vs_best_static": round(oracle["goodput"] / summary["static_best"]["goodput"], 3),
        "oracle_vs_best_static_expected": expected_gain,  # from the ground truth: the ceiling of ratio_vs_best_static
        "worst_class_ratio_vs_off": round(min(ctl["per_class"][c] / off["per_class"][c] for c in off["per_class"]), 3),
        "regret_fraction": round(1 - ctl["goodput"] / oracle["goodput"], 3),
        "decision_overhead_ms_p99": _p99(r["decision_ms"] for p in policies for r in log[p]),
        "policies": {p: {"ratio_vs_oracle": round(summary[p]["goodput"] / oracle["goodput"], 3),
                         "ratio_vs_best_static": round(summary[p]["goodput"] / summary["static_best"]["goodput"], 3),
                         "ratio_vs_off": round(summary[p]["goodput"] / off["goodput"], 3),
                         "decision_overhead_ms_p99": _p99(r["decision_ms"] for r in log[p])} for p in policies},
        "goodput": summary,
    }
    _plot(log, lead, out_dir / "controller_arms.png", out_dir / "controller_regret.png")
    if drift is not None:
        result["drift"] = _drift_and_restart(engine, classes, drift, controllers, close, lead, warmup, progress)
    return result


def _windows(log: dict[str, list[dict]], a: str, b: str, size: int) -> list[float]:
    rows_a, rows_b = log[a], log[b]
    return [round(_goodput(rows_a[i:i + size]) / _goodput(rows_b[i:i + size]), 3)
            for i in range(0, len(rows_a), size)]


def _drift_and_restart(engine, classes, drift: Workload, controllers, close, lead, warmup, progress) -> dict:
    """Class weights flip half way; one copy of the policy is also stopped and reopened there."""
    progress(f"drift stream: {drift.n_requests} requests, weights flip at 50%, '{lead}-restart' restarts there")
    names = [lead, f"{lead}-restart", "oracle", "off"]
    ctls = controllers("drift", [n for n in names if n != f"{lead}-restart"])
    ctls[f"{lead}-restart"] = controllers("restart", [lead])[lead]

    def reopen(name, old: AutotuneController) -> AutotuneController:
        url = old.store.url
        old.close()
        old.store.close()
        return AutotuneController(engine, Store(url, label="restarted"), policy=make_policy(lead, old.policy.arms))

    half = drift.n_requests // 2
    log = _run_stream(engine, drift.stream(classes), ctls,
                      restart={"at": half, "names": [f"{lead}-restart"], "reopen": reopen}, progress=progress)
    close(ctls)
    size = max(5, drift.n_requests // 10)
    settled = int(half * warmup)
    return {
        "requests": drift.n_requests,
        "ratio_vs_oracle_before_flip": round(
            _goodput(log[lead][settled:half]) / _goodput(log["oracle"][settled:half]), 3),
        "ratio_vs_oracle_after_flip": round(_goodput(log[lead][half:]) / _goodput(log["oracle"][half:]), 3),
        "ratio_vs_oracle_by_window": _windows(log, lead, "oracle", size),
        "restart_ratio_vs_oracle_by_window": _windows(log, f"{lead}-restart", "oracle", size),
        "restart_vs_uninterrupted_after_restart": round(
            _goodput(log[f"{lead}-restart"][half:]) / _goodput(log[lead][half:]), 3),
        "window_size": size,
    }


def _plot(log, policy: str, arms_png: Path, regret_png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = log[policy]
    arm_names = sorted({r["arm"] for r in rows}, key=lambda a: (a != "off", a))
    cells = sorted({r["cell"] for r in rows})
    fig, ax = plt.subplots(figsize=(10, 4))
    for c in cells:
        pts = [(i, arm_names.index(r["arm"])) for i, r in enumerate(rows) if r["cell"] == c]
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=12, label=c)
    ax.set_yticks(range(len(arm_names)), arm_names)
    ax.set_xlabel("request")
    ax.set_title(f"arm chosen by {policy}, per class and load")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(arms_png, dpi=100)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(8, 4))
    for name in log:
        if name == "oracle":
            continue
        regret, total = [], 0.0
        for r, o in zip(log[name], log["oracle"]):
            total += r["seconds"] - o["seconds"] * (r["tokens"] / o["tokens"] if o["tokens"] else 1.0)
            regret.append(total)
        ax.plot(regret, label=name)
    ax.axhline(0, color="grey", lw=0.5)
    ax.set_xlabel("request")
    ax.set_ylabel("seconds lost vs per-class oracle")
    ax.set_title("cumulative regret")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(regret_png, dpi=100)
    plt.close(fig)


# ----- bench concurrency ---------------------------------------------------------------------
def bench_concurrency(engine: SpeculativeEngine, classes: dict[str, RequestClass], clients: int = 16,
                      requests_per_client: int = 4, max_batch: int = 16, policies: tuple[str, ...] = ("off", "ucb"),
                      rounds: int = 2, progress=print) -> dict:
    """Clients on threads, each sending its requests one after another, through a controller that
    serves them one at a time (max_batch 1) or coalesces those waiting together into batches.

    Client c sends requests of class c mod len(classes). Every configuration (policy x max_batch)
    serves the same requests, configurations taking turns round by round; each keeps its
    controller (and what it learned) across rounds. Greedy outputs must be identical everywhere.
    """
    names = list(classes)
    plan = []  # per client: its class and the token ids of its requests
    for c in range(clients):
        cls = classes[names[c % len(names)]]
        first = (c // len(names)) * requests_per_client
        plan.append((cls, [engine.encode(cls.prompts[(first + j) % len(cls.prompts)]).tolist()
                           for j in range(requests_per_client)]))
    arms = default_arms(engine)
    controllers = {f"{p}/batch{b}": AutotuneController(engine, policy=p, arms=arms, max_batch=b)
                   for p in policies for b in (1, max_batch)}
    stats = {name: {"seconds": 0.0, "served": []} for name in controllers}  # served: (tokens, latency, load)
    greedy: dict[tuple[int, int], set] = defaultdict(set)
    for r in range(rounds):
        for name in _rotate(list(controllers), r):
            ctl, s = controllers[name], stats[name]

            def client(c, ctl=ctl, s=s):
                cls, requests = plan[c]
                for j, ids in enumerate(requests):
                    start = time.perf_counter()
                    out = ctl.generate(ids, cls.name, cls.max_new_tokens, cls.temperature, cls.top_p, seed=c * 1000 + j)
                    s["served"].append((out.metrics.new_tokens, time.perf_counter() - start, out.load))  # atomic
                    if cls.temperature == 0:
                        greedy[c, j].add(tuple(out.tokens))

            threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
            start = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            s["seconds"] += time.perf_counter() - start
            tokens = sum(row[0] for row in s["served"])
            progress(f"  round {r + 1}/{rounds} {name}: {tokens / s['seconds']:.0f} tokens/s so far")
    out = {}
    for name, s in stats.items():
        tokens, latency, loads = zip(*s["served"])
        out[name] = {"tokens_per_s": round(sum(tokens) / s["seconds"], 1),
                     "latency_s_p50": round(statistics.median(latency), 3),
                     "latency_s_p99": _p99(latency), "mean_load": round(statistics.fmean(loads), 2)}
    tps = {name: v["tokens_per_s"] for name, v in out.items()}
    return {"device": device_name(engine), "clients": clients, "requests_per_client": requests_per_client,
            "rounds": rounds, "max_batch": max_batch, "configs": out,
            "coalesced_vs_one_at_a_time": {p: round(tps[f"{p}/batch{max_batch}"] / tps[f"{p}/batch1"], 3)
                                           for p in policies},
            "identical_greedy_outputs": all(len(v) == 1 for v in greedy.values())}


def bench_store(n: int = 5000) -> dict:
    """Cost of `record()` on the request path (it only enqueues), and of a flush."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp, Store(f"sqlite:///{tmp}/bench.db") as store:
        times = []
        for i in range(n):
            start = time.perf_counter()
            store.record(request_class="code", arm="small:4", prompt_tokens=100, new_tokens=64, goodput=100.0 + i,
                         acceptance=0.7, acceptance_per_position=[0.9, 0.8, 0.7, 0.6], features={"load": 1})
            times.append(time.perf_counter() - start)
        start = time.perf_counter()
        store.flush()
        flush_s = time.perf_counter() - start
    times.sort()
    return {"records": n, "record_us_p50": round(times[n // 2] * 1e6, 2),
            "record_us_p99": round(times[int(n * 0.99)] * 1e6, 2),
            "record_us_mean": round(statistics.fmean(times) * 1e6, 2), "flush_all_s": round(flush_s, 4),
            "rows_per_s_written": round(n / flush_s if flush_s > 0 else math.inf)}

