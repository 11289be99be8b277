"""`autotune bench lossless`: greedy speculative output against `generate()`, token for token,
on a device and dtype, and where they part how close the target's top two logits were."""

from __future__ import annotations

import copy

import torch

from autotune.bench.common import device_name, hf_generate
from autotune.data.classes import RequestClass
from engine import OFF, Arm, SpeculativeEngine


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
    for arm in arms:  # an unknown drafter is named before anything runs
        engine.check_request(1, arm, 1)
    reference = engine.target if engine.dtype == torch.float32 else copy.deepcopy(engine.target).float()
    engine.warm_up([OFF, *arms])
    requests = identical = off_identical = 0
    divergences = []
    for name, cls in classes.items():
        for prompt in cls.prompts[:prompts_per_class]:
            ids = engine.encode(prompt).tolist()
            own, _ = hf_generate(engine, ids, max_new_tokens, None)
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
