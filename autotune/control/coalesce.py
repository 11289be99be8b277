"""Concurrent requests served together: callers on several threads, one batch per group.

A server whose clients each send one request at a time would, with the engine serialized,
decode them one after another, each forward pass feeding a single token. Serving the
requests that wait at the same moment as one batch does one forward pass per round for all
of them, which is where a server's throughput comes from (vLLM and SGLang batch every
running request each step). Here batches are formed when the engine falls free: a worker
thread (started when a request waits and none serves, stopping once none wait; or one kept
waiting, `keep_worker`) takes the oldest waiting request and every other one of its group (the
caller's choice: the controller puts all its requests in one group, or one group per request
class) up to `max_batch`, serves them and hands each caller its own result; callers only wait.
While it serves, the batch can take in requests of its group that arrive meanwhile
(`Batch.join`, between two rounds: continuous batching) and hand each caller its result as soon
as that request is done (`Batch.deliver`), so neither a newcomer nor a short request waits for
the longest request of the batch.

When requests were arriving together a moment before, the worker first waits up to `wait_s`
for the rest of them; a caller alone never waits.
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
    result: Any = None
    error: BaseException | None = None
    ready: threading.Event = field(default_factory=threading.Event)

    def settle(self, outcome: Any) -> None:
        if isinstance(outcome, BaseException):
            self.error = outcome
        else:
            self.result = outcome
        self.ready.set()


class Batch:
    """A batch being served: the items whose callers still wait, the waiting requests it may
    take in, and early answers. Items are numbered in the order they came (those it was formed
    with, then those it took in); an answered item's ticket is dropped, so a continuous batch
    that lives as long as the load does keeps only its open items (were it to keep every ticket
    it took, each round would list them all: a body of 20,000 prompts took 447 s against 2 s
    for 1,000 that way)."""

    def __init__(self, coalescer: Coalescer, group: Hashable, tickets: list[_Ticket]) -> None:
        self._coalescer = coalescer
        self.group = group
        self._open = dict(enumerate(tickets))  # item index -> ticket, until its caller has its outcome
        self.size = len(tickets)  # items so far, answered or not

    @classmethod
    def of(cls, items: list, group: Hashable = None) -> Batch:
        """A batch of these items outside any queue: nothing waits to join it."""
        return cls(Coalescer(lambda group, batch: [], 1), group, [_Ticket(group, item) for item in items])

    def pending(self) -> dict[int, Any]:
        """The items whose callers still wait for their outcome, by index, in order."""
        with self._coalescer._cv:
            return {index: t.item for index, t in self._open.items()}

    def join(self, limit: int, accept: Callable[[Any], bool] = lambda item: True) -> list:
        """Up to `limit` requests of the batch's group waiting now, oldest first, that `accept`
        takes (the others go on waiting): they become the batch's next items, numbered from the
        batch's size before the call."""
        with self._coalescer._cv:
            queue, places = self._coalescer._queue, []
            for place, t in enumerate(queue):
                if len(places) >= limit:
                    break
                if t.group == self.group and accept(t.item):
                    places.append(place)
            taken = [queue[place] for place in places]
            for place in reversed(places):  # the oldest are taken: only the head is looked at, not the queue
                del queue[place]
            for t in taken:
                self._open[self.size] = t
                self.size += 1
        return [t.item for t in taken]

    def waiting(self) -> list:
        """The requests of the batch's group waiting now, oldest first (they go on waiting)."""
        with self._coalescer._cv:
            return [t.item for t in self._coalescer._queue if t.group == self.group]

    def deliver(self, index: int, outcome: Any) -> None:
        """Hand item `index`'s caller its outcome (a result, or an exception to raise) now."""
        with self._coalescer._cv:
            self._open.pop(index).settle(outcome)


class Coalescer:
    """`submit(group, item)` from any thread; `serve(group, batch)` runs for batches of one group.

    `serve` answers each item of the `Batch` (those it took in included): through
    `Batch.deliver` as it goes, or in the list it returns, item i's outcome at index i, for the
    items not delivered. An outcome is a result, or an exception to raise in that item's
    caller (so one bad request fails alone). An exception from `serve` itself fails every
    caller of that batch still waiting.
    """

    def __init__(self, serve: Callable[[Hashable, Batch], list], max_batch: int, wait_s: float = 0.002) -> None:
        if not isinstance(max_batch, int) or max_batch < 1:  # a float would fail in the worker, leaving callers waiting
            raise ValueError(f"max_batch must be an int >= 1, got {max_batch!r}")
        self._serve = serve
        self.max_batch = max_batch
        self.wait_s = wait_s
        self._queue: list[_Ticket] = []
        self._busy = False  # a worker is gathering or serving
        self._resident: threading.Thread | None = None  # `keep_worker`'s
        self._last_batch = 1
        self._cv = threading.Condition()

    def submit(self, group: Hashable, item: Any) -> Any:
        """Queue `item` and wait for its outcome (raised if an exception)."""
        ticket = _Ticket(group, item)
        with self._cv:
            self._queue.append(ticket)
            self._cv.notify_all()  # a worker gathering a batch may wait for more
            self._start_worker()
        ticket.ready.wait()  # once answered, the ticket is the caller's alone (`Batch.deliver` dropped it)
        if ticket.error is not None:
            raise ticket.error
        return ticket.result

    def keep_worker(self) -> None:
        """From now on one worker, started here, serves every batch and waits while no request
        does (rather than a worker started by the request that finds none serving), until
        `release_worker()`. A thread takes the CPU priority of the thread that starts it: a
        server whose event loop runs below its engine (`CompletionServer`) starts the engine's
        worker this way, from a thread at the process's own priority. A batch being served
        ends first: one worker serves at a time."""
        with self._cv:
            while self._busy:
                self._cv.wait()
            if self._resident is None:
                self._resident = threading.Thread(target=self._work, name="coalescer", daemon=True)
                self._resident.start()

    def release_worker(self) -> None:
        """`keep_worker`'s worker ends once no request waits; workers start per request again."""
        with self._cv:
            self._resident = None
            self._cv.notify_all()

    def _start_worker(self) -> None:
        """Unless one serves, start a worker (called holding the lock). One that serves stops
        only once the queue is empty (`_work`), so every waiting request has one."""
        if not self._busy:
            self._busy = True
            if self._resident is None:  # a kept worker has been woken by `submit`'s notify
                threading.Thread(target=self._work, name="coalescer", daemon=True).start()

    def _work(self) -> None:
        """Serve batches while requests wait, then stop (a kept worker waits for more). A worker
        thread rather than the caller that found the engine free: that caller could not return
        before its batch ended, and a continuous batch under steady load never ends (a request of
        8 tokens waited 5.4 s, the batch's whole life, where the median took 0.08 s)."""
        while True:
            with self._cv:
                while not self._queue:
                    self._busy = False
                    self._cv.notify_all()
                    if self._resident is not threading.current_thread():
                        return
                    self._cv.wait()
                self._busy = True
                batch = self._gather()
            served = Batch(self, batch[0].group, batch)
            try:
                outcomes = self._serve(served.group, served)
            except BaseException as exc:  # every caller of this batch hears of it
                outcomes = [exc] * served.size
            with self._cv:
                for index, t in served._open.items():
                    t.settle(outcomes[index] if index < len(outcomes) else
                             RuntimeError("the batch ended without an outcome for this request"))
                served._open.clear()
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
