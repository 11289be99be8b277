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
"""

from __future__ import annotations

from typing import Protocol

import torch


class Streamer(Protocol):
    def put(self, value: torch.Tensor) -> None: ...

    def end(self) -> None: ...


def put_prompt(streamer: Streamer | None, prompt: list[int]) -> None:
    if streamer is not None:
        streamer.put(torch.tensor([prompt]))


def put_tokens(streamer: Streamer | None, tokens: list[int]) -> None:
    if streamer is not None and tokens:
        streamer.put(torch.tensor(tokens))


class EndsOnce:
    """Forwards to a streamer and lets only the first `end()` through, so a caller can end it in
    a `finally` whether or not the engine already did."""

    def __init__(self, streamer: Streamer) -> None:
        self.streamer = streamer
        self.ended = False

    def put(self, value: torch.Tensor) -> None:
        self.streamer.put(value)

    def end(self) -> None:
        if not self.ended:
            self.ended = True
            self.streamer.end()
