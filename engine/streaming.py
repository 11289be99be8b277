"""Streaming output as it is committed, through transformers' streamer protocol.

A streamer is anything with `put(token_ids)` and `end()`, the protocol of transformers'
`BaseStreamer`, so `TextStreamer` and `TextIteratorStreamer` work unchanged. As in
`generate()`, the first `put` is the prompt ([1, prompt_len]; `skip_prompt=True` drops it).
A speculative round commits several tokens at once, so each later `put` carries one round's
tokens: the accepted drafts and the target's own token. The engine calls `end()` once
decoding stops, also when it fails, so a consumer iterating a `TextIteratorStreamer` never
waits forever; a request it refuses raises before anything is streamed and is not ended
there, so a caller may serve it another way (the controller retries a refused batch request
by request). The controller ends every streamer it was given, whatever happens.

The time spent in streamers is the caller's, not the engine's: it is booked to `stream_s` and
left out of prefill, draft, verify and total time, so a slow client never reads as a slow arm
to the policy that learns from those times.

A streamer that raises (a server's client went away) stops its own request where it is: the
request returns what it has, with `stream_error` saying why, and the other requests of its
batch go on as if it had finished.

One optional method goes beyond transformers' protocol: a streamer with
`put_logprobs(entries)` gets, just before each `put` of output tokens, their log-probability
entries (one `{token id: logprob}` per token, as in `GenerationResult.logprobs`) when the
request asked for `logprobs`, so a server can stream them with the text.
"""

from __future__ import annotations

import threading
from typing import Protocol

import torch

from engine.errors import InvalidRequestError


class Streamer(Protocol):
    def put(self, value: torch.Tensor) -> None: ...

    def end(self) -> None: ...


def put_prompt(streamer: Streamer | None, prompt: list[int]) -> str | None:
    """Stream the prompt; the streamer's error, if it raised."""
    return _call(streamer, "put", torch.tensor([prompt])) if streamer is not None else None


def put_tokens(streamer: Streamer | None, tokens: list[int],
               logprobs: list[dict[int, float]] | None = None) -> str | None:
    """Stream a round's committed tokens, after their `logprobs` (if the request asked for them)
    to a streamer that takes them; the streamer's error, if it raised."""
    if streamer is None or not tokens:
        return None
    if logprobs is not None and hasattr(streamer, "put_logprobs"):
        if error := _call(streamer, "put_logprobs", logprobs):
            return error
    return _call(streamer, "put", torch.tensor(tokens))


def end_stream(streamer: Streamer | None) -> str | None:
    """End the stream; the streamer's error, if it raised."""
    return _call(streamer, "end") if streamer is not None else None


def _call(streamer: Streamer, method: str, *args) -> str | None:
    try:
        getattr(streamer, method)(*args)
    except Exception as exc:  # the streamer's failure is its request's, never the engine's
        return f"streamer.{method}() raised {type(exc).__name__}: {exc}"
    return None


def check_streamer(streamer) -> None:
    """Refuse by name what is not a streamer (transformers' protocol: `put` and `end`), before the
    request starts rather than when its first token is put."""
    missing = [name for name in ("put", "end") if not callable(getattr(streamer, name, None))]
    if missing:
        raise InvalidRequestError(f"a streamer needs put() and end() methods (transformers' BaseStreamer);"
                                  f" {type(streamer).__name__} has no {' or '.join(missing)}()")


class EndsOnce:
    """Forwards to a streamer and lets only the first `end()` through, so a caller can end it in
    a `finally` whether or not the engine already did. `started`: something was put, so serving
    the request again would stream it twice; never for a streamer that shows nothing
    (`shows_output = False`, such as a server's watch on a client waiting for the whole answer)."""

    def __init__(self, streamer: Streamer) -> None:
        check_streamer(streamer)
        self.streamer = streamer
        self.started = self.ended = False

    def put(self, value: torch.Tensor) -> None:
        self.started = self.started or getattr(self.streamer, "shows_output", True)
        self.streamer.put(value)

    def put_logprobs(self, entries: list[dict[int, float]]) -> None:
        if hasattr(self.streamer, "put_logprobs"):
            self.streamer.put_logprobs(entries)

    def end(self) -> None:
        if not self.ended:
            self.ended = True
            self.streamer.end()


class Cancellable:
    """Wraps a request's streamer (or none) so that the request stops at its next round once
    `cancelled` is set: an asyncio caller that was cancelled (its client went away) sets it,
    as vLLM aborts the request of a cancelled `generate`. Shows only what the streamer shows."""

    def __init__(self, streamer: Streamer | None, cancelled: threading.Event) -> None:
        self.streamer, self.cancelled = streamer, cancelled
        self.shows_output = streamer is not None and getattr(streamer, "shows_output", True)

    def put(self, value: torch.Tensor) -> None:
        if self.cancelled.is_set():
            raise RequestCancelled("the caller cancelled the request")
        if self.streamer is not None:
            self.streamer.put(value)

    def put_logprobs(self, entries: list[dict[int, float]]) -> None:
        if hasattr(self.streamer, "put_logprobs"):
            self.streamer.put_logprobs(entries)

    def end(self) -> None:
        if self.streamer is not None:
            self.streamer.end()


class RequestCancelled(Exception):
    """Raised by a `Cancellable` streamer: its request stops where it is."""
