"""Concurrent requests served together: callers on several threads, one batch per group.

A server whose clients each send one request at a time would, with the engine serialized,
decode them one after another, each forward pass feeding a single token. Serving the
requests that wait at the same moment as one batch does one forward pass per round for all
of them, which is where a server's throughput comes from (vLLM and SGLang batch every
running request each step). Here batches are formed when the engine falls free: the thread
that finds it free becomes the leader, takes the oldest waiting request and every other one
of its group (the caller's choice: the controller puts all its requests in one group, or one
group per request class) up to `max_batch`, serves them and hands each caller its own
result; requests that arrive meanwhile wait for the next batch. This is static batching,
not continuous: a request does not join a batch already decoding.

When requests were arriving together a moment before, the leader first waits up to `wait_s`
for the rest of them (with 16 clients of 4 classes grouped by class, the default 2 ms gathered
a class's four clients, `autotune bench concurrency`); a caller alone never waits.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any


@dataclass
class _Ticket:
    group: Hashable
    item: Any
    done: bool = False
    result: Any = None
    error: BaseException | None = None


class Coalescer:
    """`submit(group, item)` from any thread; `serve(group, items)` runs for batches of one group.

    `serve` returns one outcome per item, in order: a result, or an exception to raise in
    that item's caller (so one bad request fails alone). An exception from `serve` itself
    fails every caller of that batch.
    """

    def __init__(self, serve: Callable[[Hashable, list], list], max_batch: int, wait_s: float = 0.002) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        self._serve = serve
        self.max_batch = max_batch
        self.wait_s = wait_s
        self._queue: list[_Ticket] = []
        self._busy = False  # a leader is gathering or serving
        self._last_batch = 1
        self._cv = threading.Condition()

    def submit(self, group: Hashable, item: Any) -> Any:
        ticket = _Ticket(group, item)
        with self._cv:
            self._queue.append(ticket)
            self._cv.notify_all()
        while True:
            with self._cv:
                while self._busy and not ticket.done:
                    self._cv.wait()
                if ticket.done:
                    break
                self._busy = True
                batch = self._gather()
            try:
                outcomes = self._serve(batch[0].group, [t.item for t in batch])
            except BaseException as exc:  # every caller of this batch hears of it
                outcomes = [exc] * len(batch)
            with self._cv:
                for t, outcome in zip(batch, outcomes, strict=True):
                    if isinstance(outcome, BaseException):
                        t.error = outcome
                    else:
                        t.result = outcome
                    t.done = True
                self._last_batch = len(batch)
                self._busy = False
                self._cv.notify_all()
        if ticket.error is not None:
            raise ticket.error
        return ticket.result

    def _gather(self) -> list[_Ticket]:
        """The oldest waiting request and the rest of its group (called holding the lock)."""
        group = self._queue[0].group
        if self._last_batch > 1 or len(self._queue) > 1:  # requests have been arriving together
            deadline = time.monotonic() + self.wait_s
            while sum(t.group == group for t in self._queue) < self.max_batch:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(left)
        batch = [t for t in self._queue if t.group == group][: self.max_batch]
        taken = {id(t) for t in batch}
        self._queue = [t for t in self._queue if id(t) not in taken]
        return batch
