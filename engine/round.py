"""One speculative round, for one request or a batch: draft, verify, commit, stop, count.

A round drafts up to K tokens per row, feeds [last, d1..dK] of every row to the target in one
forward, keeps each row's longest accepted prefix plus one target token (engine/sampling.py's
`commit`), ends the rows that hit a stop, and counts what was drafted and kept. OFF is the
same round with K = 0.

The one-request path (engine.py) and the batched path (batch.py) differ only in how they feed
the models (one sequence and its own caches; rows of a masked batch cache): each hands
`decode_round` a `Feed`, and the fallback, commit, stop and counting here are the same for both.
Speculation never loses a request: a drafter that raises, or a verify that fails with drafts in
it, leaves the rest of the run OFF (`Feed.fall_back`), and the round is served without drafts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.results import GenerationMetrics, GenerationResult
from engine.sampling import Randomness, SamplingParams, commit
from engine.stopping import Stopping
from engine.streaming import Streamer, put_prompt, put_tokens


@dataclass
class Row:
    """One request's state while it decodes (alone, or as a row of a batch)."""

    tokens: list[int]  # prompt + committed output
    prompt_len: int
    max_new_tokens: int
    sampling: SamplingParams
    generator: Randomness | None
    stopping: Stopping  # the model's EOS, the request's stop_token_ids and stop strings
    metrics: GenerationMetrics
    streamer: Streamer | None = None
    stream_error: str | None = None  # its streamer raised: the request ends there
    resumes: GenerationResult | None = None  # a paused request's output so far: its streamer has the prompt
    cached: list | None = None  # a paused request's keys and values of all but its last token: no prefill
    seen: int = 0  # tokens a batched drafter's cache holds for this row
    logprobs: list[dict[int, float]] | None = None  # per output token since it started here, if asked for
    prompt_logprobs: list[dict[int, float] | None] | None = None  # if asked for (a paused request's: its own)
    done: bool = False
    stopped: bool = False  # done at an end of its own (EOS, stop token or string, criterion), not its length
    joined_s: float = 0.0  # engine seconds into the batch's run when the row joined it

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - (len(self.tokens) - self.prompt_len)

    def start(self, logits: torch.Tensor) -> None:
        """Draw the first output token from the prefill's last logits [1, V]."""
        self.tokens += self._commit(logits, [], None)
        self.stopped = self.stopping.end(self.tokens, len(self.tokens) - 1) is not None
        self.done = self.stopped or self.remaining <= 0

    def settle(self, logits: torch.Tensor, draft: list[int], q: torch.Tensor | None) -> int:
        """Commit a verify's logits [len(draft) + 1, V] over this row's drafts; how many drafts it
        kept. An end token or stop string inside the kept drafts ends the output there."""
        start = len(self.tokens)
        kept = self._commit(logits, draft, q)
        self.tokens += kept
        if (end := self.stopping.end(self.tokens, start)) is not None:
            del self.tokens[end + 1:]
            self.done = self.stopped = True
        self.done = self.done or self.remaining <= 0
        return len(kept) - 1

    def _commit(self, logits: torch.Tensor, draft: list[int], q: torch.Tensor | None) -> list[int]:
        kept, entries = commit(logits, self.tokens, draft, q, self.sampling, self.stopping, self.generator)
        if entries is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs += entries
        return kept


@dataclass
class Drafts:
    """A round's drafts: per row its tokens and their distribution [len, V] (None: greedy or a
    point mass), and how many batched drafter steps produced them (0: none ran batched)."""

    tokens: list[list[int]]
    dists: list[torch.Tensor | None]
    steps: int = 0

    @classmethod
    def none(cls, rows: int) -> Drafts:
        return cls([[] for _ in range(rows)], [None] * rows)


class Feed(Protocol):
    """How a path runs the models of a round's rows."""

    @property
    def drafting(self) -> bool:
        """A drafter is set (not OFF, and not fallen back)."""
        ...

    def draft(self, rows: list[Row], ks: list[int]) -> Drafts:
        """Up to ks[b] draft tokens for row b."""
        ...

    def verify(self, rows: list[Row], drafts: list[list[int]]) -> torch.Tensor:
        """The target's logits [B, T, V] over each row's last token and its drafts (row b's first
        len(drafts[b]) + 1 positions are its own)."""
        ...

    def undo_verify(self, rows: list[Row]) -> None:
        """A verify failed: cut the target's cache back to before it."""
        ...

    def accepted(self, b: int, row: Row, start: int, kept: int, drafts: Drafts) -> None:
        """Row b kept `kept` of its drafts, committed from position `start`: the caches forget the rest."""
        ...

    def fall_back(self, error: str) -> None:
        """Speculation failed (`error`): OFF from here."""
        ...


@dataclass
class RoundReport:
    """What a round did, per row."""

    drafted: list[int]
    accepted: list[int]
    committed: list[int]  # output tokens added (a stop may cut kept ones)
    ended: float  # the clock when the round was done


def decode_round(feed: Feed, rows: list[Row], k: int, clock: Callable[[], float],
                 totals: GenerationMetrics | None = None, began: float | None = None) -> RoundReport:
    """One round of `rows` at K = `k` (fewer drafts where a row has fewer tokens left). Each row's
    metrics count the round; `totals` (a batch's) count it once more for the batch. `began`: when
    the round's time starts (now if None); a loop that passes where its last round and streaming
    ended books every engine second between them to draft or verify time."""
    began = clock() if began is None else began
    ks = [max(0, min(k, r.remaining - 1)) if feed.drafting else 0 for r in rows]
    drafts = Drafts.none(len(rows))
    verifying = began  # a round that drafts nothing has no draft time
    if max(ks, default=0) > 0:
        try:
            drafts = feed.draft(rows, ks)
        except Exception as exc:  # speculation must never lose a request
            feed.fall_back(f"{type(exc).__name__}: {exc}")
        verifying = clock()
    try:
        logits = feed.verify(rows, drafts.tokens)
    except Exception as exc:
        if not any(drafts.tokens):
            raise
        # The target could not take a step this wide (a model bug, memory): OFF from here, from the
        # cache as it was before the step.
        feed.undo_verify(rows)
        feed.fall_back(f"verify: {type(exc).__name__}: {exc}")
        drafts = Drafts.none(len(rows))
        logits = feed.verify(rows, drafts.tokens)
    starts = [len(r.tokens) for r in rows]
    accepted = []
    for b, (row, draft, start) in enumerate(zip(rows, drafts.tokens, starts)):
        kept = row.settle(logits[b, : len(draft) + 1], draft, drafts.dists[b])
        feed.accepted(b, row, start, kept, drafts)
        accepted.append(kept)
    verified = clock()
    width = 1 + max(map(len, drafts.tokens))
    steps = max(drafts.steps, width - 1)  # as far as the longest row drafted
    for row, draft, kept in zip(rows, drafts.tokens, accepted):
        row.metrics.add_round(verifying - began, steps, width, verified - verifying)
        row.metrics.add_drafts(len(draft), kept)
    if totals is not None:
        totals.add_round(verifying - began, steps, width, verified - verifying)
    return RoundReport([len(d) for d in drafts.tokens], accepted,
                       [len(r.tokens) - start for r, start in zip(rows, starts)], verified)


def stream(rows: list[Row], starts: list[int], metrics: GenerationMetrics, prompt: bool = False,
           since: float | None = None) -> float:
    """Hand each row's tokens from `starts` on (after its prompt, with `prompt`) to its streamer,
    booking the seconds that took to `metrics.stream_s`: they are the caller's, and a slow client
    must not read as a slow arm. A row whose streamer raises is done. `since`: where the engine's
    own time ended (a round's `ended`; now if None), so what lies between is booked here too and
    no second falls between the times of a loop's rounds. Returns when it was done."""
    began = time.perf_counter() if since is None else since
    for r, start in zip(rows, starts):
        if r.streamer is not None:
            first = put_prompt(r.streamer, r.tokens[:start]) if prompt and r.resumes is None else None
            entries = None if r.logprobs is None else r.logprobs[start - r.prompt_len:len(r.tokens) - r.prompt_len]
            r.stream_error = first or put_tokens(r.streamer, r.tokens[start:], entries)
            r.done = r.done or r.stream_error is not None
    ended = time.perf_counter()
    metrics.stream_s += ended - began
    return ended
