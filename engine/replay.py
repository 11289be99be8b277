"""How far a drafter's drafts would have been kept along a sequence the target already produced.

Under greedy decoding a draft token is kept exactly when it equals the target's next token,
and the output does not depend on the arm, so once a request is served the acceptance of any
drafter's drafts from every position follows from the output alone: a model drafter's from one
teacher-forced forward over prompt + output, prompt lookup's from a scan, a feature head's from
the target's features (engine/feature.py). Sampled requests get the same in expectation:
rejection sampling keeps a draft from q where the target samples from p with probability
sum_x min(p(x), q(x)). A seeded sampled request, coupled (engine/coupled.py), gets it exactly:
its output is the target's own draws, and a draft is kept where the drafter's draw from the
same noise equals the token there. Each drafter that declares `Capabilities(replay=True)` says
so for itself (`replay_chains`); the controller turns the chains into rounds and time
(autotune/rewards/replay.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.coupled import PositionNoise, drawn_equal
from engine.sampling import SamplingParams, adjust_logits, probabilities


@dataclass
class ReplayInputs:
    """A served sequence, as every drafter's `replay_chains` reads it."""

    sequence: list[int]  # prompt + output
    start: int  # the first position a round drafts at: the output's second token (the first is the prefill's)
    k: int  # drafts per round
    target: torch.Tensor | None  # [len(sequence) - start, V]: the target's distributions; None: exact
    sampling: SamplingParams | None
    target_model: torch.nn.Module  # for drafters that draft from its features
    memo: dict = field(default_factory=dict)  # per sequence: what drafters sharing a model computed once
    noise: PositionNoise | None = None  # a coupled request's (`replay_noise`): drafters draw with it


@dataclass
class ReplayChains:
    """From each position from `start` on, the acceptance probability of each draft of a round
    starting there (a chain stops where a draft leaves the sequence)."""

    chains: list[list[float]]
    proposed: list[int] | None = None  # tokens proposed from each position; None: always k
    looked_up: list[bool] | None = None  # a hybrid's: drafted by its lookup at each position


def teacher_forced_logits(model, sequence: list[int], start: int, sampling: SamplingParams | None,
                           hold: Callable[[torch.Tensor, int], torch.Tensor] | None = None) -> torch.Tensor:
    """Logits whose row j predicts sequence[start + j], from one forward over the whole sequence,
    with the request's edits as the engine and its drafters apply them (the output begins one
    token before `start`)."""
    ids = torch.tensor([sequence], device=model.device)
    with torch.inference_mode():
        logits = model(ids, use_cache=False, logits_to_keep=len(sequence) - start + 1).logits[0, :-1]
        if sampling is None:
            return logits
        return adjust_logits(logits, sequence[:start], sequence[start:], start - 1, sampling, hold)



def model_chains(model, inputs: ReplayInputs) -> list[list[float]]:
    """For each position: the acceptance probability of each of k drafts of a model drafter
    running `model`. `inputs.memo` keeps each model's acceptances, so drafters that run the
    same model (a model drafter and a hybrid of it) pay for one forward."""
    sequence, start, memo = inputs.sequence, inputs.start, inputs.memo
    if model not in memo:
        logits = teacher_forced_logits(model, sequence, start, inputs.sampling)
        if inputs.noise is not None:
            accept = drawn_equal(inputs.noise, probabilities(logits, inputs.sampling),
                                 list(range(start, len(sequence))), sequence[start:])
        elif inputs.target is None:
            accept = (logits.argmax(-1) == torch.tensor(sequence[start:], device=logits.device)).float()
        else:
            accept = torch.minimum(inputs.target, probabilities(logits, inputs.sampling)).sum(-1)
        memo[model] = accept if isinstance(accept, list) else accept.tolist()
    accept = memo[model]
    return [accept[j:j + inputs.k] for j in range(len(accept))]


def lookup_chains(drafter, sequence: list[int], start: int, k: int,
                 target: torch.Tensor | None) -> tuple[list[list[float]], list[int]]:
    """For each position t >= start: acceptance probabilities of the (up to k) tokens proposed by
    a drafter that drafts from the tokens alone (prompt lookup), found by a scan, and how many.

    A draft that differs from the output leaves the path the target's distributions were
    taken on, so the chain stops there (its own probability still counts when sampled).
    """
    chains, proposed = [], []
    for t in range(start, len(sequence)):
        draft, _ = drafter.propose(sequence[:t], k, None, None)
        chain = []
        for i, token in enumerate(draft[: len(sequence) - t]):
            matches = token == sequence[t + i]
            chain.append(float(matches) if target is None else float(target[t - start + i, token]))
            if not matches:
                break
        chains.append(chain)
        proposed.append(len(draft))
    return chains, proposed
