"""Requests waiting at the same moment are served together, grouped, in order, errors apart."""

import threading
import time

import pytest

from autotune.control.coalesce import Coalescer


@pytest.mark.parametrize("kept", [False, True], ids=["worker-per-busy-spell", "kept-worker"])
def test_waiting_requests_of_a_group_are_served_together_in_arrival_order(kept):
    release = threading.Event()
    batches, workers = [], set()

    def serve(group, batch):
        items = list(batch.pending().values())
        batches.append((group, list(items)))
        workers.add(threading.current_thread())
        if len(batches) == 1:
            release.wait(5)  # the first batch is still being served while the others arrive
        return [ValueError(f"bad {i}") if i == 3 else i * 10 for i in items]

    coalescer = Coalescer(serve, max_batch=4, wait_s=0.01)
    if kept:
        coalescer.keep_worker()
    outcomes = {}

    def call(group, item):
        try:
            outcomes[item] = coalescer.submit(group, item)
        except ValueError as exc:
            outcomes[item] = str(exc)

    threads = []
    for group, item in [("g", 0), ("g", 1), ("g", 2), ("h", 6), ("g", 3), ("g", 4), ("g", 5), ("h", 7)]:
        threads.append(threading.Thread(target=call, args=(group, item)))
        threads[-1].start()
        deadline = time.monotonic() + 5
        while (not batches or sum(len(items) for _, items in batches) + len(coalescer._queue) < len(threads)) \
                and time.monotonic() < deadline:
            time.sleep(0.001)  # arrivals in a known order, the first taken before the next arrives
    release.set()
    for t in threads:
        t.join(5)
    # the oldest waiting request leads; its group fills the batch up to max_batch, other groups wait
    assert batches == [("g", [0]), ("g", [1, 2, 3, 4]), ("h", [6, 7]), ("g", [5])]
    assert outcomes == {0: 0, 1: 10, 2: 20, 3: "bad 3", 4: 40, 5: 50, 6: 60, 7: 70}
    if kept:  # every batch served by the one thread keep_worker started, which ends once released
        assert workers == {coalescer._resident}
        kept_worker = coalescer._resident
        coalescer.release_worker()
        kept_worker.join(5)
        assert not kept_worker.is_alive()
        assert coalescer.submit("g", 8) == 80  # served by a worker started for it, as before


def test_a_failing_batch_fails_each_of_its_callers_and_the_next_batch_still_runs():
    calls = []

    def serve(group, batch):
        calls.append(list(batch.pending().values()))
        if len(calls) == 1:
            raise RuntimeError("engine down")
        return calls[-1]

    coalescer = Coalescer(serve, max_batch=2)
    with pytest.raises(RuntimeError, match="engine down"):
        coalescer.submit("g", 1)
    assert coalescer.submit("g", 2) == 2


def test_a_batch_takes_in_requests_arriving_while_it_is_served_and_answers_each_when_done():
    """The first request's caller gets its answer while its batch goes on (a worker serves, not
    the caller: a continuous batch may never end), and the batch keeps nothing of that call.
    A request left without an outcome gets an error, not a wait."""
    batches, joined, outcomes, kept = [], [], {}, []
    first_answered = threading.Event()

    def serve(group, batch):
        items = batch.pending()
        batches.append((group, list(items.values())))
        if items == {0: 0}:
            deadline = time.monotonic() + 5
            while len(coalescer._queue) < 3 and time.monotonic() < deadline:
                time.sleep(0.001)  # requests 1 (g), 2 (h) and 3 (g) arrive while 0 is served
            joined.extend(batch.join(5, accept=lambda item: item != 3))  # 2: another group; 3: refused
            batch.deliver(0, "early 0")
            # its caller has its answer while the batch goes on (callers do not serve batches)
            kept.append((first_answered.wait(5), batch.pending(), batch.size))
            return []  # item 1 (joined) was neither delivered nor answered here
        return [f"{group}{item}" for item in items.values()]

    coalescer = Coalescer(serve, max_batch=8, wait_s=0.0)

    def call(group, item):
        try:
            outcomes[item] = coalescer.submit(group, item)
        except RuntimeError as exc:
            outcomes[item] = str(exc)
        if item == 0:
            first_answered.set()

    threads = [threading.Thread(target=call, args=("g", 0))]
    threads[0].start()
    while not batches:
        time.sleep(0.001)
    for group, item in [("g", 1), ("h", 2), ("g", 3)]:
        threads.append(threading.Thread(target=call, args=(group, item)))
        threads[-1].start()
    for t in threads:
        t.join(5)
    assert joined == [1] and kept == [(True, {1: 1}, 2)]
    assert outcomes == {0: "early 0", 1: "the batch ended without an outcome for this request", 2: "h2", 3: "g3"}
    assert batches[0] == ("g", [0]) and sorted(batches[1:]) == [("g", [3]), ("h", [2])]  # 1 rode with 0


def test_a_batch_that_lives_as_long_as_the_load_keeps_only_requests_not_yet_answered():
    """A continuous batch takes requests in and answers them one by one for as long as they come:
    it holds those still waiting, not every one it served (it used to list them all each round)."""
    still_open = []

    def serve(group, batch):
        batch.deliver(0, "first")
        deadline = time.monotonic() + 5
        while batch.size < 30 and time.monotonic() < deadline:
            for item in batch.join(1):
                still_open.append(len(batch.pending()))
                batch.deliver(batch.size - 1, item * 10)
            time.sleep(0.001)
        still_open.append(len(batch.pending()))
        return []

    coalescer = Coalescer(serve, max_batch=1, wait_s=0.0)
    outcomes = {}

    def call(item):
        outcomes[item] = coalescer.submit("g", item)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(30)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    coalescer.idle()  # every caller has its answer before the batch ends
    first = next(i for i, o in outcomes.items() if o == "first")
    assert outcomes == {i: "first" if i == first else i * 10 for i in range(30)}
    assert still_open == [1] * 29 + [0]
