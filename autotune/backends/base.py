"""What the controller needs of an engine it does not own: serve one request on an arm, and say
what happened (output tokens, times, drafted and accepted counts).

This project's own engine is served by `AutotuneController`, which can also replay a request on
the arms it did not play and price them with a cost model; a backend reached over HTTP cannot,
and `BackendController` learns from the served request alone. Terms used throughout:
- decode time: from the first output token to the last; a request's decode rate, its output
  tokens after the first over that time, is what speculation changes (prefill it does not).
- drafted, accepted: draft tokens proposed and kept by the target, as the engine counts them;
  None where the engine does not say for this request.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from engine import Arm

TokenSink = Callable[[list[int]], None]  # takes a streamed response's output token ids as they arrive


class BackendError(RuntimeError):
    """An engine could not serve a request: down, too slow, or it answered with an error. The
    message names the engine, its address and the cause."""


@dataclass(frozen=True)
class BackendRequest:
    prompt: list[int]  # token ids, so every engine sees the same input
    max_new_tokens: int
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int | None = None


@dataclass(frozen=True)
class BackendResponse:
    tokens: list[int]  # output token ids ([] where the engine returns text only)
    text: str
    prompt_tokens: int
    new_tokens: int
    prefill_s: float  # until the first output token (the engine's own figure, or the time to first byte)
    decode_s: float  # from the first output token to the last
    total_s: float  # the whole call, as the client saw it
    finish_reason: str  # "stop" or "length"
    drafted: int | None = None
    accepted: int | None = None

    @property
    def decode_rate(self) -> float | None:
        """Output tokens after the first per second of decoding; None with too few to tell."""
        if self.new_tokens < 2 or self.decode_s <= 0:
            return None
        return (self.new_tokens - 1) / self.decode_s

    @property
    def acceptance(self) -> float | None:
        if not self.drafted or self.accepted is None:
            return None
        return self.accepted / self.drafted


class Backend(Protocol):
    """An engine the controller serves requests on. `arms`: what it can serve (OFF among them);
    `serve` raises BackendError when it cannot, within its timeout, and hands the output's token
    ids to `on_tokens` as they come where it streams them (otherwise not at all). `variable_k`: the drafters
    whose K is a request field, one engine state for all their Ks (so that what a request shows
    of one K says something of another); others are one server per arm."""

    name: str
    variable_k: frozenset[str]

    def arms(self) -> list[Arm]: ...

    def serve(self, request: BackendRequest, arm: Arm, on_tokens: TokenSink | None = None) -> BackendResponse: ...

    def close(self) -> None: ...
