"""`autotune bench engine`: the engine against transformers, side by side on the same prompts.

OFF against `generate()` shows the decode loop adds nothing; the arm against transformers'
assisted generation (same drafter and K) shows what the engine's speculation is worth; a
compiled engine also runs against its eager twin.
"""

from __future__ import annotations

from collections import defaultdict

from transformers import NoRepeatNGramLogitsProcessor

from autotune.bench.common import compile_total, device_name, hf_generate, rotate
from engine import OFF, Arm, HybridDrafter, ModelDrafter, NGramDrafter, SamplingParams, SpeculativeEngine
from engine.feature import FeatureDrafter


def eager_twin(engine: SpeculativeEngine) -> SpeculativeEngine:
    """The same models on the default eager path, to measure a compiled engine against."""
    def twin(d):  # a drafter of its own: add_drafter gives a model drafter the twin's runner
        if isinstance(d, HybridDrafter):
            return HybridDrafter(twin(d.inner), d.lookup.max_ngram, d.lookup.min_ngram)
        if isinstance(d, FeatureDrafter):
            return FeatureDrafter(d.head)
        return d.model if isinstance(d, ModelDrafter) else d

    drafters = {n: twin(d) for n, d in engine.drafters.items()}
    return SpeculativeEngine(engine.target, drafters, engine.tokenizer, engine.device, engine.dtype, compile=False)


def bench_engine(engine: SpeculativeEngine, prompts: list[str], arm: Arm, max_new_tokens: int = 64,
                 repetition_penalty: float = 1.0, no_repeat_ngram: int = 0) -> dict:
    """Engine OFF vs `generate()`, engine on `arm` vs transformers assisted generation, every
    method greedy with `repetition_penalty` and, when `no_repeat_ngram` N > 0, no repeated
    N-gram: generate()'s own `no_repeat_ngram_size`, the engine's through its processor class
    passed as a caller's `logits_processor` (what a processor costs).

    A compiled engine is also measured against its eager twin (same models), side by side, and
    its one-time compile cost is reported; compiling happens before any timing. A feature
    drafter or a model drafter on a compiled engine also drafts step by step (its `one_graph`
    off), to show what a round as one graph saves of its draft time.
    """
    engine.check_request(1, arm, 1)  # an unknown drafter is named before anything runs
    processors = [NoRepeatNGramLogitsProcessor(no_repeat_ngram)] if no_repeat_ngram else []
    sampling = SamplingParams(repetition_penalty=repetition_penalty, logits_processor=processors)
    options = dict(repetition_penalty=repetition_penalty, no_repeat_ngram_size=no_repeat_ngram or None)
    encoded = [engine.encode(p).tolist() for p in prompts]
    totals = defaultdict(float)
    tokens = defaultdict(int)
    identical = True
    spec_metrics = []
    off_metrics = []
    draft_time, draft_rounds = defaultdict(float), defaultdict(int)  # per engine: a speculative arm's drafting
    # transformers has assisted generation and prompt lookup, no feature drafting
    assisted = isinstance(engine.drafters.get(arm.drafter), (ModelDrafter, NGramDrafter))
    methods = ["hf_generate", "engine_off", *(["hf_assisted"] if assisted else []), "engine_spec"]
    engines = {"engine": engine}
    compile_report = None
    drafter = engine.drafters.get(arm.drafter)
    drafting = getattr(drafter, "inner", drafter)  # what drafts outside a hybrid's lookup rounds
    one_graph = hasattr(drafting, "one_graph")
    if engine.cache_kind == "compiled":
        compile_report = engine.warm_up([OFF, arm])
        engines["eager"] = eager_twin(engine)
        methods += ["eager_off", "eager_spec"]
        if one_graph:
            engines["steps"] = engine
            methods.append("steps_spec")
    warm = encoded[0]  # first calls allocate and pick kernels: keep them out of the timings
    hf_generate(engine, warm, 8, None, **options)
    if assisted:
        hf_generate(engine, warm, 8, arm, **options)
    for e in engines.values():
        e.generate(warm, OFF, 8, sampling)
        e.generate(warm, arm, 8, sampling)
    for i, ids in enumerate(encoded):
        outputs = {}
        for method in rotate(methods, i):
            if method.startswith("hf"):
                out, seconds = hf_generate(engine, ids, max_new_tokens, arm if method == "hf_assisted" else None,
                                           **options)
            else:
                which, what = method.split("_")
                if which == "steps":
                    drafting.one_graph = False
                result = engines[which].generate(ids, OFF if what == "off" else arm, max_new_tokens, sampling)
                if which == "steps":
                    drafting.one_graph = True
                if what == "spec":
                    draft_time[which] += result.metrics.draft_s
                    draft_rounds[which] += result.metrics.draft_rounds
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
        "repetition_penalty": repetition_penalty,
        "no_repeat_ngram": no_repeat_ngram,
        "tokens_per_s": {m: round(v, 2) for m, v in tps.items()},
        "ratio_off_vs_hf_generate": round(tps["engine_off"] / tps["hf_generate"], 3),
        "ratio_spec_vs_hf_assisted": round(tps["engine_spec"] / tps["hf_assisted"], 3) if assisted else None,
        "speedup_vs_off": round(speedup, 3),
        "off_step_ms": round(off_step * 1000, 3),
        "acceptance": round(a, 4),
        "cost_ratio": round(c, 4),
        "bound_ratio": round(speedup / expected, 3) if expected > 0 else None,
        "identical_outputs": identical,
        "draft_ms_per_round": {which: round(draft_time[which] / n * 1000, 3) for which, n in draft_rounds.items() if n},
    }
    if compile_report is not None:
        result["ratio_off_vs_eager_off"] = round(tps["engine_off"] / tps["eager_off"], 3)
        result["ratio_spec_vs_eager_spec"] = round(tps["engine_spec"] / tps["eager_spec"], 3)
        result["compile_s"] = {m: {g: round(t, 2) for g, t in r.items()} for m, r in compile_report.items()}
        result["compile_s_total"] = compile_total(compile_report)
    return result
