"""Drafter-invariant speculative sampling: one seed, one output, whatever drafts.

Each position's token is drawn by the Gumbel-max trick, argmax over v of log p(v) + G(v), whose
noise G comes from the request's seed and the position alone; a draft token is kept exactly
when it equals the target's draw there. Every committed token is then the target's own draw,
so the output is a function of the prompt, the sampling options and the seed: the same on OFF
and on every drafter and K, alone and in a batch. Each token is still an exact sample of the
target's distribution, since the noise at a position is independent of the positions before
it. A drafter that draws its proposals with the same noise (`draw`) agrees with the target
whenever the two distributions put the noise's argmax on the same token, which is often where
they are close, though less often than the standard rejection rule keeps a draft.

Terms: p, the target's distribution at a position [V]; q, the drafter's; a position is the
token's index in the whole sequence (prompt included), so a request paused and resumed draws
the same noise. Reference: Daliri et al., "Coupling without Communication and Drafter-Invariant
Speculative Decoding" (2024).
"""

from __future__ import annotations

import torch

_MASK = (1 << 64) - 1


def _mix(seed: int, position: int) -> int:
    """A 64-bit seed for (seed, position), splitmix64's finalizer over both, so that nearby
    seeds and positions get unrelated streams."""
    z = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


class PositionNoise:
    """A sampled request's randomness when it is coupled: Gumbel noise per position from `seed`."""

    def __init__(self, seed: int, device: torch.device | str = "cpu") -> None:
        self.seed = seed
        self.device = torch.device(device)
        self._generator = torch.Generator(device=self.device)

    def gumbel(self, position: int, size: int) -> torch.Tensor:
        """The noise [size] of `position`: the same for the same seed and position, always."""
        self._generator.manual_seed(_mix(self.seed, position))
        uniform = torch.rand(size, generator=self._generator, device=self.device)
        tiny = torch.finfo(uniform.dtype).tiny
        exponential = -torch.log(uniform.clamp(min=tiny))
        return -torch.log(exponential.clamp(min=tiny))

    def draw(self, probs: torch.Tensor, position: int) -> int:
        """The token at `position` drawn from `probs` [V] (an exact sample of it over the noise)."""
        return int((torch.log(probs) + self.gumbel(position, probs.shape[-1]).to(probs.device)).argmax())


def verify_coupled(target_probs, draft: list[int], noise: PositionNoise, start: int) -> tuple[int, int]:
    """(drafts kept, the next token) for target_probs [K+1, V] over `draft`, whose first token
    sits at position `start`: drafts are kept while each equals the target's own draw there."""
    n = 0
    while True:
        chosen = noise.draw(target_probs[n], start + n)
        if n == len(draft) or draft[n] != chosen:
            return n, chosen
        n += 1


def drawn_equal(noise: PositionNoise, probs: torch.Tensor, positions: list[int], tokens: list[int]) -> list[float]:
    """1.0 where the draw from probs[i] [V] at positions[i] is tokens[i], else 0.0: whether a
    coupled drafter's draft there would have been kept, along a sequence the target drew."""
    return [float(noise.draw(p, position) == token) for p, position, token in zip(probs, positions, tokens)]


def replay_noise(sampling, device: torch.device | str) -> PositionNoise | None:
    """A served request's noise, where a replay can draw it again: coupled and seeded, on the
    engine's `device` (a generator's stream differs from one kind of device to another)."""
    if sampling is None or not sampling.couples or sampling.seed is None:
        return None
    return PositionNoise(sampling.seed, device)
