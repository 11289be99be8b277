"""Where speculation can pay on a device: `autotune bench limits`.

Speculation trades extra target work for fewer target steps, so what decides it is hardware:
how close one plain decode step gets to the memory-bandwidth limit (weight bytes / copy
bandwidth), how much more a step of K+1 tokens costs than a step of one, and how cheap a
drafter step is next to a target step. This measures the three on an engine's own runners
(compiled when the engine is), for the project's family or for random-weight models shaped
like Llama-3.1-8B and Llama-3.2-1B in bfloat16, so a production-sized pair can be measured
without downloading either.
"""

from __future__ import annotations

import statistics

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

from autotune.bench.common import device_name
from engine import ModelDrafter, SpeculativeEngine
from engine.runner import ModelRunner

LLAMA_SHAPES = {
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256),
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True),
}


def llama_shaped_engine(device: str, compile: bool | None = None) -> SpeculativeEngine:
    """Random bf16 models shaped like Llama-3.1-8B (target) and Llama-3.2-1B (drafter)."""
    if torch.device(device).type != "cuda":
        raise ValueError("the Llama-shaped models need a CUDA device: the target alone is 16 GB of bfloat16 weights")
    models = {}
    for name, shape in LLAMA_SHAPES.items():
        config = LlamaConfig(max_position_embeddings=4096, rope_theta=500000.0, eos_token_id=None, **shape)
        with torch.device(device):
            models[name] = LlamaForCausalLM._from_config(config, dtype=torch.bfloat16)
    target = models.pop("llama-3.1-8b")
    return SpeculativeEngine(target, models, device=device, dtype=torch.bfloat16, compile=compile)


def weight_bytes_per_step(model: PreTrainedModel) -> int:
    """Bytes of weights one decode step reads: every parameter, except that the input embedding
    table is only looked up (one row) unless it is also the output projection."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embedding = model.get_input_embeddings().weight
    output = model.get_output_embeddings()
    if output is None or output.weight is not embedding:
        total -= embedding.numel() * embedding.element_size()
    return total


def copy_bandwidth(engine: SpeculativeEngine, nbytes: int = 256 * 2**20, repeats: int = 10) -> float:
    """Bytes per second moved by a copy on the engine's device (read + write), large enough to miss caches."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=engine.device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    began = engine._sync()
    for _ in range(repeats):
        dst.copy_(src)
    return 2 * nbytes * repeats / (engine._sync() - began)


def step_seconds(steps: dict[str, tuple[ModelRunner, int, int]], engine: SpeculativeEngine, start: int,
                 repeats: int) -> dict[str, float]:
    """Median seconds of each named (runner, tokens, logits kept) step at position `start`.

    The steps take turns, one call each per repeat, so a slow moment of a shared machine hits
    them all alike. Each call is rolled back first; the first round is dropped (on a compiled
    runner it compiles the graph for that length)."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats + 1):
        for name, (runner, length, keep) in steps.items():
            tokens = torch.zeros((1, length), dtype=torch.long, device=engine.device)
            runner.truncate(start)
            began = engine._sync()
            runner.step(tokens, start, keep)
            times[name].append(engine._sync() - began)
    return {name: statistics.median(t[1:]) for name, t in times.items()}


def bench_limits(engine: SpeculativeEngine, max_k: int = 16, prompt_tokens: int = 64, repeats: int = 30) -> dict:
    """Target step vs the bandwidth limit, verify cost of K+1 tokens vs 1, drafter/target step cost."""
    drafters = {n: d for n, d in engine.drafters.items() if isinstance(d, ModelDrafter)}
    bandwidth = copy_bandwidth(engine)
    prompt = torch.zeros(prompt_tokens, dtype=torch.long, device=engine.device)
    result = {"device": device_name(engine), "cache": engine.cache_kind, "dtype": str(engine.dtype).split(".")[-1],
              "copy_bandwidth_GBps": round(bandwidth / 1e9, 1), "prompt_tokens": prompt_tokens}
    with torch.inference_mode():
        engine.runner.begin(prompt, prompt_tokens + max_k + 2)
        steps = {f"target K={k}": (engine.runner, k + 1, k + 1) for k in range(0, max_k + 1)}  # K=0: plain decoding
        for name, drafter in drafters.items():
            drafter.runner.begin(prompt, prompt_tokens + 2)
            steps[f"drafter {name}"] = (drafter.runner, 1, 1)
        seconds = step_seconds(steps, engine, prompt_tokens, repeats)
    one = seconds["target K=0"]
    weights = weight_bytes_per_step(engine.target)
    limit = bandwidth / weights  # the copy's bandwidth counts bytes read and written; a step moves its weights once
    result["target"] = {"weight_MB": round(weights / 2**20, 1), "step_ms": round(one * 1000, 3),
                        "tokens_per_s": round(1 / one, 1), "bandwidth_limit_tokens_per_s": round(limit, 1),
                        "fraction_of_limit": round(1 / one / limit, 3)}
    result["verify_cost_vs_one_token"] = {str(k): round(seconds[f"target K={k}"] / one, 3) for k in range(1, max_k + 1)}
    result["drafters"] = {
        name: {"weight_MB": round(weight_bytes_per_step(d.model) / 2**20, 1),
               "step_ms": round(seconds[f"drafter {name}"] * 1000, 3),
               "cost_ratio": round(seconds[f"drafter {name}"] / one, 3)}
        for name, d in drafters.items()
    }
    return result
