"""What a policy learned, durable and shared: a journal of its updates, folded.

Each update the controller teaches its policy is journaled in the store, written by the same
thread and in the same transactions as the observations, so what was learned survives whatever
the observations survive, kill -9 included. A checkpoint saves the policy's state as the fold of
the journal through some id; resuming loads the newest checkpoint and folds the updates after it.

Several controllers on one store (replicas, the fleet case) each journal their own updates.
Folding the journal in id order adds up everyone's evidence: none overwrites another. Each
controller folds what the others journaled as it syncs, off the request path, and adopts the
fold, with its own updates not yet written applied on top, so replicas learn from each other
while they run. Folds from different starting checkpoints agree up to rounding (a policy keeps
some running sums).
"""

from __future__ import annotations

import copy
import logging
import threading
from dataclasses import dataclass

from engine import Arm
from policies import POLICIES, make_policy
from policies.base import Context, Outcome, Policy

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Update:
    """One `policy.update(context, arm, outcome)`; `seq` counts a controller's updates from 1."""

    seq: int
    context: Context
    arm: Arm
    outcome: Outcome

    def row(self, policy: str) -> dict:
        """As the store's journal keeps it."""
        o = self.outcome
        return {"seq": self.seq, "policy": policy, "request_class": self.context.request_class,
                "load": self.context.load, "features": self.context.features, "arm": str(self.arm),
                "goodput": o.goodput, "reward": o.reward, "acceptance": o.acceptance, "new_tokens": o.new_tokens,
                "siblings": {arm: list(value) for arm, value in o.siblings.items()}}

    @classmethod
    def from_row(cls, row: dict, arms: dict[str, Arm]) -> Update | None:
        """The update a journal row holds; None for an arm this policy does not have (a replica
        or an earlier run with other arms), whose evidence it cannot use."""
        arm = arms.get(row["arm"])
        if arm is None:
            return None
        siblings = {name: tuple(value) for name, value in (row["siblings"] or {}).items() if name in arms}
        outcome = Outcome(row["goodput"], row["reward"], row["acceptance"], row["new_tokens"], siblings)
        return cls(row["seq"], Context(row["request_class"], row["load"], row["features"] or {}), arm, outcome)


class SharedLearning:
    """The journal of `policy`'s updates in `store`: `resume` before serving, `add` after each
    update (the policy lock held), `sync` now and then off the request path."""

    def __init__(self, store, policy: Policy) -> None:
        self.store = store
        self.policy = policy
        self._arms = {str(arm): arm for arm in policy.arms}
        self._seq = 0
        self._local: list[Update] = []  # taught here and not yet seen in the fold
        self._folded: Policy = copy.deepcopy(policy)  # the fold of the journal through `_through`
        self._through = 0
        self._changed: set[str] = set()  # keys the fold changed since the last checkpoint attempt
        self._sync_lock = threading.Lock()

    def resume(self) -> int:
        """Load the newest checkpoint and fold the journal after it, into the policy and the fold;
        how many updates were folded."""
        states, self._through = self.store.load_checkpoint(self.policy.name)
        self._folded.load_state_dict(states)
        folded, _, _ = self._fold_new()
        self.policy.load_state_dict(self._folded.state_dict())
        return folded

    def add(self, context: Context, arm: Arm, outcome: Outcome) -> None:
        """Journal an update just taught to the policy (the policy lock held, so the journal's
        order is the order the policy learned in)."""
        self._seq += 1
        update = Update(self._seq, context, arm, outcome)
        self._local.append(update)
        self.store.record_update(**update.row(self.policy.name))

    def sync(self, policy_lock: threading.Lock) -> int:
        """Fold the journal's new updates, everyone's; save a checkpoint; where other controllers
        journaled some, adopt the fold with this one's unwritten updates on top. Returns how many
        updates were folded."""
        with self._sync_lock:
            folded, mine_through, others = self._fold_new()
            if self._changed:
                state = self._folded.state_dict()
                keys = self._changed | {key for key in state if "@" not in key}  # policy-wide: contextual's history
                self.store.save_checkpoint(self.policy.name, {key: state[key] for key in keys if key in state},
                                           self._through)
                # Saved, or refused because a newer checkpoint has them; kept if the save raised,
                # for the next one (a checkpoint past them without them would lose their updates).
                self._changed = set()
            fresh = copy.deepcopy(self._folded) if others else None
            with policy_lock:
                self._local = [u for u in self._local if u.seq > mine_through]
                if fresh is not None:
                    for update in self._local:
                        fresh.update(update.context, update.arm, update.outcome)
                    self.policy.load_state_dict(fresh.state_dict())
            return folded

    def _fold_new(self) -> tuple[int, int, bool]:
        """Fold the updates journaled after `_through`: (how many, the highest seq of this run's
        among them, whether another run's were among them)."""
        folded, mine_through, others = 0, 0, False
        for row in self.store.policy_updates(self.policy.name, after=self._through):
            self._through = row["id"]
            if row["run_id"] == self.store.run_id:
                mine_through = row["seq"]
            else:
                others = True
            update = Update.from_row(row, self._arms)
            if update is None:
                continue
            try:
                self._folded.update(update.context, update.arm, update.outcome)
            except Exception as exc:  # a row no policy of this kind can take: skipped, not the journal's end
                logger.warning("journaled update %s skipped: %s", row["id"], exc)
                continue
            self._changed.add(update.context.key)
            folded += 1
        return folded, mine_through, others


def learned_states(store, policy_name: str) -> dict[str, dict]:
    """What a controller resuming `policy_name` starts from, read without writing (`inspect`, the
    notebooks): the newest checkpoint with the journal after it folded, by a policy of that name
    over the arms they name, with default settings (a controller's own settings may weigh that
    tail differently). A policy that is not a known learning one: the checkpoint alone."""
    states, through = store.load_checkpoint(policy_name)
    tail = store.policy_updates(policy_name, after=through)
    if not tail or policy_name not in POLICIES or not POLICIES[policy_name].learns:
        return states
    names = {arm for state in states.values() for arm in state.get("rows", {})} | {row["arm"] for row in tail}
    policy = make_policy(policy_name, [Arm.parse(name) for name in sorted(names)])
    SharedLearning(store, policy).resume()
    return policy.state_dict()
