"""What the arms not played would have earned on a request the controller served.

A key's first requests, then requests within a small share of its serving time
(`counterfactual_budget`), replay every arm worth it (rewards/replay.py: exact when greedy);
between replays, and for drafters the replay cannot run, the played drafter's other Ks come
from its acceptance per position (rewards/siblings.py) and its hybrids from a scan of the
output (`hybrid_estimates`).
"""

from __future__ import annotations

import copy
import functools
import threading
import time
from typing import TYPE_CHECKING

from autotune.control.settings import ControllerSettings
from autotune.rewards.costs import CostModel
from autotune.rewards.replay import arm_rewards, draft_cost_owner, hybrid_estimates
from autotune.rewards.siblings import sibling_rewards
from engine import Arm, GenerationMetrics, GenerationResult, SpeculativeEngine
from engine.drafters import capabilities
from engine.feature import Features
from policies import Context, Policy

if TYPE_CHECKING:
    from autotune.control.controller import PendingRequest

# Rows of a batch a replay runs (`arm_rewards`' replay_rows): replaying every row costs about
# what serving the batch did, and the rows live longest on the arm played make a batch last.
BATCH_REPLAY_ROWS = 4


class OtherArms:
    """Estimates {arm: (reward, weight)} of the arms not played, for the policy. `served`: requests
    served per key (a batch counts each), which the controller saves and resumes."""

    def __init__(self, engine: SpeculativeEngine, policy: Policy, settings: ControllerSettings,
                 replay_features: bool, policy_lock: threading.Lock, engine_lock: threading.Lock) -> None:
        self.engine, self.policy, self.settings = engine, policy, settings
        self.replay_features = replay_features
        self.policy_lock, self.engine_lock = policy_lock, engine_lock
        self.ks: dict[str, list[int]] = {}  # drafter -> the K values among the policy's arms
        for arm in policy.arms:
            if not arm.is_off:
                self.ks.setdefault(arm.drafter, []).append(arm.k)
        # drafter -> whose draft costs by K price its other Ks (a hybrid's inner drafter, where the arms
        # have it, so that calibration and requests measure its costs)
        self._draft_cost_owner = {drafter: owner if (owner := draft_cost_owner(engine, drafter)) in self.ks
                                  else drafter for drafter in self.ks}
        self.served: dict[str, int] = {}
        self._replay_share: dict[str, list[float]] = {}  # key -> [serving s, replay s] after learning, last replay s

    def estimate(self, context: Context, arm: Arm, reward: float, schedule, requests: list[PendingRequest],
                 results: list[GenerationResult], served: GenerationMetrics, costs: CostModel,
                 features: Features | None) -> dict:
        """Estimated rewards of the arms not played: {arm: (reward, weight)} for the policy."""
        if schedule is not None or any(r.fell_back for r in results) or not self.policy.learns:
            return {}
        served = served.without_probes()  # the arm's own rounds
        key = context.key
        with self.policy_lock:
            before = self.served.get(key, 0)
            self.served[key] = before + len(results)
            # This request's own OFF step, as its reward's: the target's steps slow down with the
            # context (long prompts) and the machine's moment.
            off_step = costs.off_step_during(served, arm.drafter) or costs.off_step()
            learning = before < self.settings.counterfactual_requests
            share = self._replay_share.get(key)
            if share is None:  # a key past its learning requests when this process met it (resumed,
                # or warm-started offline): a replay is taken to cost about a request until one has
                # run, so that a restart does not replay every such key at once
                share = self._replay_share[key] = [0.0, 0.0, 0.0 if learning else served.total_s]
            if not learning:
                share[0] += served.total_s
            replay = learning or share[1] + share[2] <= self.settings.counterfactual_budget * share[0]
            if replay:  # other threads' requests go on adding to the costs while this one replays
                costs = copy.deepcopy(costs)
                worth = self._worth_replaying(context, learning)
        if replay and off_step is not None:
            # A batch lasts as long as its slowest rows: those live longest on the arm played go first
            order = sorted(range(len(results)), key=lambda i: -results[i].metrics.rounds)
            served_requests = [(requests[i].ids, results[i].tokens, requests[i].max_new_tokens) for i in order]
            started = time.perf_counter()
            with self.engine_lock:
                estimates = arm_rewards(self.engine, worth, costs, served_requests,
                                        served.prefill_s - served.draft_prefill_s, off_step,
                                        [requests[i].sampling for i in order], features, BATCH_REPLAY_ROWS)
            with self.policy_lock:
                share[2] = time.perf_counter() - started
                if not learning:
                    share[1] += share[2]
            estimates.pop(str(arm), None)  # the arm played has its measured reward
            replayed = {a: (r, self.settings.counterfactual_weight) for a, r in estimates.items()}
        else:
            replayed = {}
        # The played drafter's other Ks from its acceptance per position: all a drafter the replay
        # cannot run (layer skip; feature heads unless `replay_features`), or any drafter between
        # replays, has to tell about them; left out while replaying, each of its Ks was played
        # once to be known, K=1 too, on a new controller's requests.
        return self.siblings(served, arm, reward, costs) | self._hybrids(served, arm, reward, costs, requests,
                                                                          results) | replayed

    def _worth_replaying(self, context: Context, learning: bool) -> list[Arm]:
        """The arms to replay: those the policy finds worth it, feature heads only with
        `replay_features`, and then, on a key's first request, every head's arm. What the other
        classes measured of a head comes from their text: after code classes had priced the prose
        head, a prose class that came later would neither replay nor play it, although it is
        their fastest arm."""
        def from_features(arm: Arm) -> bool:  # a head, or a hybrid around one
            return not arm.is_off and capabilities(self.engine.drafters[arm.drafter]).features

        worth = [a for a in self.policy.worth_replaying(context) if self.replay_features or not from_features(a)]
        if learning and self.replay_features:
            worth += [a for a in self.policy.arms if from_features(a) and a not in worth]
        return worth

    def siblings(self, metrics: GenerationMetrics, arm: Arm, reward: float, costs: CostModel) -> dict:
        """The played drafter's other Ks, estimated from this request's rounds (`sibling_rewards`)."""
        owner = self._draft_cost_owner.get(arm.drafter, arm.drafter)
        return sibling_rewards(metrics, arm, reward, self.ks.get(arm.drafter, ()),
                               functools.partial(costs.draft_cost, owner),
                               functools.partial(costs.verify_cost, drafter=arm.drafter))

    def _hybrids(self, metrics: GenerationMetrics, arm: Arm, reward: float, costs: CostModel,
                 requests: list[PendingRequest], results: list[GenerationResult]) -> dict:
        """The hybrids of the played drafter (a lookup chained before it), estimated from one greedy
        request's output and rounds (`hybrid_estimates`); sampled requests and batches tell nothing."""
        if len(requests) != 1 or not requests[0].sampling.greedy:
            return {}
        request = requests[0]
        return hybrid_estimates(self.engine, arm, metrics, reward, request.ids, results[0].tokens,
                                request.max_new_tokens, costs, self.ks)
