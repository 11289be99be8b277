"""How K evolves between rounds inside one request.

The controller picks an arm per request; a schedule may still move K round by round.
`ConstantK` keeps the arm's K; `HeuristicK` is transformers' assisted-generation rule
(+2 after a fully accepted draft, -1 otherwise).
"""

from __future__ import annotations

from typing import Protocol

from engine.arms import MAX_K, MIN_K


class KSchedule(Protocol):
    def next_k(self, k: int, drafted: int, accepted: int) -> int: ...


class ConstantK:
    def next_k(self, k: int, drafted: int, accepted: int) -> int:
        return k


class HeuristicK:
    def __init__(self, up: int = 2, down: int = 1, k_min: int = MIN_K, k_max: int = MAX_K) -> None:
        self.up, self.down, self.k_min, self.k_max = up, down, k_min, k_max

    def next_k(self, k: int, drafted: int, accepted: int) -> int:
        if drafted == 0:
            return k
        k = k + self.up if accepted == drafted else k - self.down
        return max(self.k_min, min(self.k_max, k))
