"""A policy and what keeps what it learns: both controllers learn through one.

Each update is taught to the policy, journaled in the store with the observations
(learning.py: it survives kill -9, and controllers sharing a store add up what they learn),
and every `save_every` updates a snapshot of the controller's own state is handed to a saver
that writes it off the request path (saving.py).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable

from autotune.control.learning import SharedLearning
from autotune.control.saving import BackgroundSaver
from engine import Arm
from policies import Context, Outcome, Policy


class Learner:
    """Teaches `policy` and keeps what it learns in `store` (None: in memory only). `lock`
    guards the policy (the caller's, held around `update`); `snapshot` gives the caller's own
    state to save beside the policy's journal (the lock held)."""

    def __init__(self, policy: Policy, store, save_every: int, lock: threading.Lock,
                 snapshot: Callable[[], dict]) -> None:
        if not isinstance(save_every, int) or isinstance(save_every, bool) or save_every < 1:
            raise ValueError(f"save_every must be an int >= 1, got {save_every!r}")
        self.policy, self.store, self.save_every, self.lock = policy, store, save_every, lock
        self.updates = 0
        self._snapshot = snapshot
        self.journal = SharedLearning(store, policy) if store is not None and policy.learns else None
        sync = functools.partial(self.journal.sync, lock) if self.journal is not None else (lambda: None)
        self._saver = BackgroundSaver(store, sync) if store is not None else None

    def resume(self) -> None:
        """Fold what the store's journal holds into the policy."""
        if self.journal is not None:
            self.journal.resume()

    def update(self, context: Context, arm: Arm, outcome: Outcome) -> None:
        """Teach the policy, journal the update, and save now and then (the lock held)."""
        self.policy.update(context, arm, outcome)
        if self.journal is not None:
            self.journal.add(context, arm, outcome)
        self.updates += 1
        if self._saver is not None and self.updates % self.save_every == 0:
            self._saver.submit(self._snapshot())

    def record(self, **observation) -> None:
        """One served request's observation, in the store (store.Store.record)."""
        if self.store is not None:
            self.store.record(policy=self.policy.name, **observation)

    def save(self) -> None:
        """Write what was learned now, a checkpoint of the policy through every update journaled;
        raises the store's error if it cannot (kept for the next save)."""
        if self._saver is None:
            return
        with self.lock:
            self._saver.submit(self._snapshot())
        try:
            self.store.flush()  # the journal written, so that the checkpoint reaches every update
        finally:
            self._saver.flush()
