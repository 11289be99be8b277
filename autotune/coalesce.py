"""Concurrent requests served together: callers on several threads, one batch per group.

A server whose clients each send one request at a time would, with the engine serialized,
decode them one after another, each forward pass feeding a single token. Serving the
requests that wait at the same moment as one batch does one forward pass per round for all
of them, which is where a server's throughput comes from (vLLM and SGLang batch every
running request each step). Here batches are formed when the engine falls free: a worker
thread (started when a request waits and none serves; it stops once none wait) takes the
oldest waiting request and every other one of its group (the caller's choice: the controller
puts all its requests in one group, or one group per request class) up to `max_batch`, serves
them and hands each caller its own result; callers only wait. While it serves, the batch can
take in requests of its group that arrive meanwhile (`Batch.join`, between two rounds:
continuous batching) and hand each caller its result as soon as that request is done
(`Batch.deliver`), so neither a newcomer nor a short request waits for the longest request
of the batch.

When requests were arriving together a moment before, the worker first waits up to `wait_s`
for the rest of them (with 16 clients of 4 classes grouped by class, the default 2 ms gathered
a class's four clients, `autotune bench concurrency`); a caller alone never waits.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class _Ticket:
    """A waiting request. Its caller waits on its own `ready` event, not on the coalescer's
    condition: woken all at once, every caller of a queue of thousands re-took the lock each time
    a batch ended (a body of 4,000 prompts took 77 s against 1.5 s for 1,000)."""

    group: Hashable
    item: Any
    done: bool = False
    result: Any = None
    error: BaseException | None = None
    ready: threading.Event = field(default_factory=threading.Event)

    def settle(self, outcome: Any) -> None:
        if isinstance(outcome, BaseException):
            self.error = outcome
        else:
            self.result = outcome
        self.done = True
        self.ready.set()


class Batch:
    """A batch being served: its items, the waiting requests it may take in, and early answers."""

    def __init__(self, coalescer: Coalescer, group: Hashable, tickets: list[_Ticket]) -> None:
        self._coalescer = coalescer
        self.group = group
        self._tickets = tickets

    @classmethod
    def of(cls, items: list, group: Hashable = None) -> Batch:
        """A batch of these items outside any queue: nothing waits to join it."""
        return cls(Coalescer(lambda group, batch: [], 1), group, [_Ticket(group, item) for item in items])

    @property
    def items(self) -> list:
        """The batch's items: those it was formed with, then those it took in, in order."""
        return [t.item for t in self._tickets]

    def join(self, limit: int, accept: Callable[[Any], bool] = lambda item: True) -> list:
        """Up to `limit` requests of the batch's group waiting now, oldest first, that `accept`
        takes (the others go on waiting): they become the batch's next items."""
        with self._coalescer._cv:
            taken = [t for t in self._coalescer._queue if t.group == self.group and accept(t.item)][:max(limit, 0)]
            ids = {id(t) for t in taken}
            self._coalescer._queue = [t for t in self._coalescer._queue if id(t) not in ids]
            self._tickets += taken
        return [t.item for t in taken]

    def waiting(self) -> list:
        """The requests of the batch's group waiting now, oldest first (they go on waiting)."""
        with self._coalescer._cv:
            return [t.item for t in self._coalescer._queue if t.group == self.group]

    def answered(self, index: int) -> bool:
        """Whether item `index`'s caller already has its outcome (`deliver`)."""
        with self._coalescer._cv:
            return self._tickets[index].done

    def deliver(self, index: int, outcome: Any) -> None:
        """Hand item `index`'s caller its outcome (a result, or an exception to raise) now."""
        with self._coalescer._cv:
            self._tickets[index].settle(outcome)


class Coalescer:
    """`submit(group, item)` from any thread; `serve(group, batch)` runs for batches of one group.

    `serve` returns one outcome per item of the `Batch` (those it took in included), in order:
    a result, or an exception to raise in that item's caller (so one bad request fails
    alone); an item already answered through `Batch.deliver` keeps that answer. An exception
    from `serve` itself fails every caller of that batch still waiting.
    """

    def __init__(self, serve: Callable[[Hashable, Batch], list], max_batch: int, wait_s: float = 0.002) -> None:
        if not isinstance(max_batch, int) or max_batch < 1:  # a float would fail in the worker, leaving callers waiting
            raise ValueError(f"max_batch must be an int >= 1, got {max_batch!r}")
        self._serve = serve
        self.max_batch = max_batch
        self.wait_s = wait_s
        self._queue: list[_Ticket] = []
        self._busy = False  # a worker is gathering or serving
        self._last_batch = 1
        self._cv = threading.Condition()

    def submit(self, group: Hashable, item: Any) -> Any:
        """Queue `item` and wait for its outcome (raised if an exception)."""
        ticket = _Ticket(group, item)
        with self._cv:
            self._queue.append(ticket)
            self._cv.notify_all()  # a worker gathering a batch may wait for more
            self._start_worker()
        ticket.ready.wait()
        with self._cv:  # a continuous batch may outlive this call by far: it keeps nothing of it
            error, result = ticket.error, ticket.result
            ticket.item = ticket.result = ticket.error = None
        if error is not None:
            raise error
        return result

    def _start_worker(self) -> None:
        """Unless one serves, start a worker (called holding the lock). One that serves stops
        only once the queue is empty (`_work`), so every waiting request has one."""
        if not self._busy:
            self._busy = True
            threading.Thread(target=self._work, name="coalescer", daemon=True).start()

    def _work(self) -> None:
        """Serve batches while requests wait, then stop. A worker thread rather than the caller
        that found the engine free: that caller could not return before its batch ended, and a
        continuous batch under steady load never ends (a request of 8 tokens waited 5.4 s, the
        batch's whole life, where the median took 0.08 s)."""
        while True:
            with self._cv:
                if not self._queue:
                    self._busy = False
                    self._cv.notify_all()
                    return
                batch = self._gather()
            served = Batch(self, batch[0].group, batch)
            try:
                outcomes = self._serve(served.group, served)
            except BaseException as exc:  # every caller of this batch hears of it
                outcomes = [exc] * len(served._tickets)
            with self._cv:
                for t, outcome in zip(served._tickets, outcomes, strict=True):
                    if not t.done:
                        t.settle(outcome)
                self._last_batch = len(batch)

    def idle(self) -> None:
        """Wait until no batch is being served (what a caller got back may not be the end of
        its batch's work: the policy still learns from its last rounds)."""
        with self._cv:
            while self._busy:
                self._cv.wait()

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
