"""A coalesced batch kept going (continuous batching), as the controller serves one.

Requests that arrive join it between rounds, each is handed back as soon as it is done, and
every `decide_every` rounds the controller learns how those rounds went (`learn_segment`) and
decides the arm for the next ones, so no batch drains for a decision. Replays price whole
requests, so segments are not replayed. The session may never drain, so nothing is kept of a
request past its delivery.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from autotune.control.coalesce import Batch
from engine import Arm, BatchRequest, BatchSession, GenerationMetrics, GenerationResult, InvalidRequestError
from policies import Context

if TYPE_CHECKING:
    from autotune.control.controller import ControlledResult, PendingRequest


class BatchController(Protocol):
    """What a continuous batch asks of the controller that serves it."""

    max_batch: int  # rows at most
    decide_every: int  # rounds between decisions

    def serving(self) -> AbstractContextManager:
        """The engine held for this batch alone, the GPU measured (`so_far()`) while it is."""
        ...

    def open_batch(self, arm: Arm) -> BatchSession: ...

    def key(self, classes: list[str]) -> str:
        """The policy's key for requests of these classes served together."""
        ...

    def decide(self, context: Context, segments: bool = False,
               fits: Callable[[Arm], bool] | None = None) -> tuple[Context, Arm]: ...

    def fits(self, arm: Arm, request: PendingRequest) -> bool:
        """Whether `request` can join a batch on `arm`."""
        ...

    def row_result(self, request: PendingRequest, result: GenerationResult, context: Context, decision_s: float,
                   gpu: tuple[float | None, float | None], began: float) -> ControlledResult:
        """What the caller of a request the batch finished gets (and the store records)."""
        ...

    def learn_segment(self, arm: Arm, context: Context, done: GenerationMetrics, committed: int, row_rounds: int,
                      fell_back: bool) -> None:
        """Learn how a stretch of the batch's rounds on `arm` went."""
        ...


@dataclass
class Segment:
    """Rounds of a continuous batch decoded on one decision: the decision, and the batch's
    counters where the segment starts."""

    context: Context
    decision_s: float
    totals: GenerationMetrics
    committed: int
    row_rounds: int

    @classmethod
    def starting(cls, context: Context, session: BatchSession, decision_s: float) -> Segment:
        return cls(context, decision_s, session.totals(), session.committed, session.row_rounds)


@dataclass
class _Row:
    """A request in the session until it is delivered: its item's index in the coalesced batch,
    and when the session took it in."""

    request: PendingRequest
    ticket: int
    began: float


class ContinuousBatch:
    """Serves coalesced `batch` to its end. `resumed`: the batch's one request was paused for
    requests that arrived (its rest, and when the engine began on it); the arm is decided for
    all of them, and they join at once."""

    def __init__(self, controller: BatchController, batch: Batch,
                 resumed: tuple[BatchRequest, float] | None = None) -> None:
        self.ctl, self.batch, self.resumed = controller, batch, resumed
        self.rows: dict[int, _Row] = {}  # session index -> its request, until delivered
        self.session: BatchSession | None = None

    def serve(self) -> list:
        """Serve every item, delivering each outcome as it comes; [] (nothing left to return)."""
        ctl = self.ctl
        with ctl.serving() as self.gpu:
            first = list(self.batch.pending().values())
            started = time.perf_counter()
            coming = self.batch.waiting()[:ctl.max_batch - 1] if self.resumed is not None else []
            context = Context(ctl.key([r.request_class for r in first + coming]), len(first) + len(coming),
                              first[0].features)
            # the paused request goes on in this batch whatever the arm: one that cannot take it is not played
            fits = (lambda arm: ctl.fits(arm, first[0])) if self.resumed is not None else None
            context, arm = ctl.decide(context, segments=True, fits=fits)
            self.session = ctl.open_batch(arm)
            try:
                self._take(0, first, *self.resumed or ())
            except InvalidRequestError:  # refused before any decoding: the controller serves each alone
                raise
            except Exception as exc:
                self._take_apart(0, first, exc)
            segment = Segment.starting(context, self.session, time.perf_counter() - started)
            while True:
                self._admit()
                self._deliver(segment)
                if not self.session.live_rows and not self.session.prefilling:
                    break
                if self.session.live_rows and \
                        self.session.metrics.rounds - segment.totals.rounds >= ctl.decide_every:
                    segment = self._decide_again(segment)
                self.session.step()
            self._learn(segment)
            self.session.close()
        return []

    def _take(self, start: int, requests: list[PendingRequest], rest: BatchRequest | None = None,
              began: float | None = None) -> None:
        """Prefill `requests`, the batch's items from `start` on, into the session."""
        began = began if began is not None else time.perf_counter()
        added = self.session.add([rest] if rest is not None else [
            BatchRequest(r.ids, r.max_new_tokens, r.sampling, r.streamer) for r in requests])
        for ticket, (i, request) in enumerate(zip(added, requests, strict=True), start):
            self.rows[i] = _Row(request, ticket, began)

    def _take_apart(self, start: int, requests: list[PendingRequest], exc: Exception) -> None:
        """`_take(start, requests)` raised `exc` (memory, a model error): each of several is taken
        alone, and one that fails alone gets its error in its own caller while the batch goes on."""
        if len(requests) == 1:
            self.batch.deliver(start, exc)
            return
        for ticket, request in enumerate(requests, start):
            try:
                self._take(ticket, [request])
            except Exception as alone:
                self._take_apart(ticket, [request], alone)

    def _admit(self) -> None:
        """Requests waiting for the batch's group join it while there is room."""
        session = self.session
        room = self.ctl.max_batch - session.live_rows - session.prefilling
        if room > 0 and (joining := self.batch.join(room, lambda request: self.ctl.fits(session.arm, request))):
            start = self.batch.size - len(joining)
            try:
                self._take(start, joining)
            except Exception as exc:
                self._take_apart(start, joining, exc)

    def _deliver(self, segment: Segment) -> None:
        """Hand back every request done (or whose chunked prefill failed alone) since the last call."""
        ctl = self.ctl
        for i, result in self.session.finished():
            row = self.rows.pop(i)
            self.batch.deliver(row.ticket, ctl.row_result(row.request, result, segment.context, segment.decision_s,
                                                          self.gpu.so_far(), row.began))
        for i, exc in self.session.failed():  # the batch goes on without it
            self.batch.deliver(self.rows.pop(i).ticket, exc)

    def _decide_again(self, segment: Segment) -> Segment:
        """Learn the segment that ends here, and decide the arm of the next one for the rows live."""
        self._learn(segment)
        started = time.perf_counter()
        live = [self.rows[i].request for i in self.session.live]
        context = Context(self.ctl.key([r.request_class for r in live]), len(live), live[0].features)
        context, arm = self.ctl.decide(context, segments=True)
        if arm != self.session.arm:
            try:
                self.session.switch(arm)
            except InvalidRequestError:  # a live row too long for that drafter: keep the arm
                pass
        return Segment.starting(context, self.session, time.perf_counter() - started)

    def _learn(self, segment: Segment) -> None:
        session = self.session
        self.ctl.learn_segment(session.arm, segment.context, session.totals().minus(segment.totals),
                               session.committed - segment.committed, session.row_rounds - segment.row_rounds,
                               session.fell_back)
