"""Saves of what the controller learned, off the request path.

Written where an update comes due, a save would hold the policy lock while the database is slow
or locked by another process, and stall every request behind it. Instead the request path only
takes a snapshot (under the lock, in memory) and hands it over; one thread writes it. Snapshots not yet
written merge (a key's newest state wins), so a slow database is written the latest state, not
a backlog. A save the database refuses is logged and merged back under anything newer, and
written with the next one; `flush` writes what is pending now and raises if it cannot. After
each save the thread runs `sync` (the policy's journal: autotune/control/learning.py).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)

Snapshot = dict[str, dict[str, dict]]  # policy name -> key -> state, as Store.save_policy_states takes it


def _merge(older: Snapshot, newer: Snapshot) -> Snapshot:
    out = {policy: dict(states) for policy, states in older.items()}
    for policy, states in newer.items():
        out.setdefault(policy, {}).update(states)
    return out


class BackgroundSaver:
    """Writes snapshots to `store` on a thread of its own (started on the first `submit`), then
    calls `sync`."""

    def __init__(self, store, sync: Callable[[], object] = lambda: None) -> None:
        self.store = store
        self.sync = sync
        self._pending: Snapshot = {}
        self._cv = threading.Condition()
        self._writing = False
        self._thread: threading.Thread | None = None

    def submit(self, snapshot: Snapshot) -> None:
        """Queue `snapshot` to be written; returns at once."""
        with self._cv:
            self._pending = _merge(self._pending, snapshot)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="autotune-saver", daemon=True)
                self._thread.start()
            self._cv.notify_all()

    def flush(self) -> None:
        """Write everything submitted so far before returning; raises the database's error if the
        write fails (what was pending stays pending)."""
        with self._cv:
            while self._writing:
                self._cv.wait()
            snapshot, self._pending = self._pending, {}
            self._writing = True
        try:
            if snapshot:
                self.store.save_policy_states(snapshot)
            self.sync()
        except BaseException:
            self._restore(snapshot)
            raise
        finally:
            with self._cv:
                self._writing = False
                self._cv.notify_all()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._pending or self._writing:
                    self._cv.wait()
                snapshot, self._pending = self._pending, {}
                self._writing = True
            try:
                self.store.save_policy_states(snapshot)
                self.sync()
            except Exception as exc:  # a locked or gone database: kept, written with the next save
                logger.warning("the policy state could not be saved (kept, saved again later): %s", exc)
                self._restore(snapshot)
                with self._cv:
                    self._writing = False
                    self._cv.notify_all()
                    self._cv.wait(1.0)  # not a busy retry loop: the next submit, or a second from now
                continue
            with self._cv:
                self._writing = False
                self._cv.notify_all()

    def _restore(self, snapshot: Snapshot) -> None:
        with self._cv:
            self._pending = _merge(snapshot, self._pending)
