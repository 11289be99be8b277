"""One request's measured acceptance per position, extended to the same drafter's other Ks."""

from __future__ import annotations

import functools
from collections.abc import Callable


def kept_survival(metrics, k: int) -> list[float] | None:
    """Per position up to `k`, the share of a request's rounds whose draft there was kept (every
    round counted, drafted that far or not); None if it has fewer positions or kept no first draft.
    A request's rounds; a batch's counters add up its rows' drafts, over at least as many
    row-rounds as rows drafted a first token."""
    row_rounds = max(metrics.rounds, metrics.drafted_per_position[0] if metrics.drafted_per_position else 0)
    if not row_rounds:
        return None
    survival = [kept / row_rounds for kept in metrics.accepted_per_position[:k]]
    return survival if len(survival) == k and survival[0] else None


def sibling_rewards(metrics, arm, reward: float, ks, round_cost: Callable[[int], float | None] | None = None,
                    verify_cost: Callable[[int], float | None] | None = None, exact_weight: float = 0.5,
                    extrapolated_weight: float = 0.25) -> dict[str, tuple[float, float]]:
    """Estimated rewards of (same drafter, other K) from one request run at constant K.

    Per round, K drafts yield 1 + sum_{i<K} S_i tokens, S_i being the drafts kept at position i
    per round (measured per position), at the cost of a K-token draft round plus one verify. For
    K' < K every S_i is measured; for K' > K the last one's fall is extended geometrically, so
    those estimates get less weight. S_i counts every round, drafted that far or not: a lookup
    that found a short match (or none) drafts fewer than K, and over the rounds that drafted
    position i only, a hybrid's deep positions would look kept as often as its first ones.

    `round_cost(k)` (the cost model's seconds of a k-token draft round, of the drafter whose rounds
    cost what K makes them: a hybrid's inner one, its lookups cost next to nothing at any K) says
    how draft cost grows with K, and `verify_cost(tokens)` (its seconds of a verify of that many
    tokens after this drafter) how the verify grows, both scaled to this request's own rounds;
    without them, K steps at this request's mean step cost and a verify that costs the same at
    every K, which would tell the policy that larger Ks are faster than they are.
    """
    if arm.is_off or not metrics.draft_steps or not metrics.rounds:
        return {}
    survival = kept_survival(metrics, arm.k)
    if survival is None:
        return {}
    step = survival[-1] / survival[-2] if len(survival) > 1 and survival[-2] > 0 else survival[0]
    needed = {arm.k, *ks}
    draft_per_round = metrics.draft_s / metrics.rounds
    if round_cost is not None and (here_cost := round_cost(arm.k)):
        draft_cost = {k: draft_per_round * (round_cost(k) or 0.0) / here_cost for k in needed}
    else:
        draft_cost = {k: k * metrics.draft_s / metrics.draft_steps for k in needed}
    verify_per_round = {k: metrics.verify_s / metrics.rounds for k in needed}
    widths = {w: rounds for w, (_, rounds) in metrics.verify_by_width.items() if rounds}
    if verify_cost is not None and widths:
        verify_cost = functools.cache(verify_cost)  # each K asks for the same few widths: a median each
        modelled = {k: _verify_seconds(widths, arm.k, k, verify_cost) for k in needed}
        if all(v is not None for v in modelled.values()) and modelled[arm.k] > 0:
            verify_per_round = {k: verify_per_round[k] * modelled[k] / modelled[arm.k] for k in needed}

    def rate(k: int) -> float:
        accepted = sum(survival[i] if i < len(survival) else survival[-1] * step ** (i - len(survival) + 1)
                       for i in range(k))
        return (1 + accepted) / (draft_cost[k] + verify_per_round[k])

    here = rate(arm.k)
    return {
        f"{arm.drafter}:{k}": (reward * rate(k) / here, exact_weight if k < arm.k else extrapolated_weight)
        for k in ks if k != arm.k
    }


def _verify_seconds(widths: dict[int, int], k: int, other_k: int,
                    verify_cost: Callable[[int], float | None]) -> float | None:
    """Modelled verify seconds of a request's rounds (`widths`: tokens per verify -> rounds, at K
    = `k`) had they drafted up to `other_k`: a round that drafted all k drafts `other_k`, one
    that drafted fewer (a lookup that found a short match) as many, up to `other_k`."""
    total = 0.0
    for width, rounds in widths.items():
        cost = verify_cost(other_k + 1 if width - 1 >= k else min(width, other_k + 1))
        if cost is None:
            return None
        total += rounds * cost
    return total
