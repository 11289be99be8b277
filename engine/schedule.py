"""How a request's rounds go beyond its arm: K between rounds, and what a scheduler asks of them.

The controller picks an arm per request; a schedule may still move K round by round.
`ConstantK` keeps the arm's K; `HeuristicK` is transformers' assisted-generation rule
(+2 after a fully accepted draft, -1 otherwise). `RoundControl` is what a caller that schedules
requests (a controller, a server) asks of a request's rounds besides decoding it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from engine.arms import MAX_K, MIN_K
from engine.errors import InvalidRequestError


@dataclass(frozen=True)
class RoundControl:
    """`pause`, asked before every round of a request served alone, stops decoding when it returns
    True, so that a server can move the request into a batch with requests that arrived meanwhile:
    the result then holds the output so far and `rest`, which `BatchSession.add` finishes as a
    batch row (re-prefilling prompt and output, as vLLM's recompute preemption does); its streamer
    is not ended. `probe_off`: on a drafter, serve this many rounds OFF (K = 0), spread over the
    output, timed into `metrics.probe_s`: OFF's step measured among the request's own rounds,
    since the machine's step moves within tenths of a second."""

    pause: Callable[[], bool] | None = None
    probe_off: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.probe_off, bool) or not isinstance(self.probe_off, int) or self.probe_off < 0:
            raise InvalidRequestError(f"probe_off must be an int >= 0, got {self.probe_off!r}")


NO_CONTROL = RoundControl()


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
