"""What every other arm would have done on a greedy request just served.

Under greedy decoding a draft token is kept exactly when it equals the target's next token,
and the output does not depend on the arm. So once a request is served, how many tokens any
drafter would have had accepted from any position follows from the output alone: a model
drafter's greedy prediction at every position comes from one teacher-forced forward over
prompt + output (its drafts stay right exactly while those predictions match), and n-gram
lookup is a scan. Replaying the decode loop over those run lengths gives each arm's rounds
and drafted tokens; the measured costs (draft seconds per token per drafter, verify seconds
per round by step length) turn them into time. The result is a paired estimate of every
arm's reward on the same request, so the bandit compares arms without the noise of
comparing different prompts (per-request rewards spread by about +-30 % across prompts).

Sampled requests have no such closed form (acceptance is random), so they get none.
"""

from __future__ import annotations

import torch

from engine import Arm, ModelDrafter, NGramDrafter, SpeculativeEngine

VERIFY_SLOPE_PRIOR = 0.04  # extra verify cost per drafted token, as a share of a 1-token step (CPU, demo family)


class CostModel:
    """Discounted measured costs: seconds per draft step per drafter, per verify round by T (one load bucket)."""

    def __init__(self, discount: float = 0.98) -> None:
        self.discount = discount
        self.draft: dict[str, list[float]] = {}  # drafter -> [seconds, tokens]
        self.verify: dict[int, list[float]] = {}  # tokens per verify -> [seconds, rounds]

    def observe(self, arm: Arm, metrics) -> None:
        if not metrics.rounds:
            return
        if metrics.draft_steps:
            self._add(self.draft, arm.drafter, metrics.draft_s, metrics.draft_steps)
        for width, (seconds, rounds) in metrics.verify_by_width.items():  # as fed: n-gram rounds vary
            self._add(self.verify, width, seconds, rounds)

    def _add(self, table: dict, key, seconds: float, count: float) -> None:
        row = table.setdefault(key, [0.0, 0.0])
        row[0] = row[0] * self.discount + seconds
        row[1] = row[1] * self.discount + count

    def draft_cost(self, drafter: str) -> float | None:
        row = self.draft.get(drafter)
        return row[0] / row[1] if row and row[1] > 0 else None

    def verify_cost(self, tokens: int) -> float | None:
        """Seconds of a verify of `tokens`: measured, else a least-squares line through the measured ones."""
        points = {t: s / n for t, (s, n) in self.verify.items() if n > 0}
        if tokens in points:
            return points[tokens]
        if not points:
            return None
        if len(points) == 1:
            (t0, v0), = points.items()
            return v0 * (1 + VERIFY_SLOPE_PRIOR * (tokens - t0))
        ts, vs = list(points), list(points.values())
        mean_t, mean_v = sum(ts) / len(ts), sum(vs) / len(vs)
        slope = sum((t - mean_t) * (v - mean_v) for t, v in zip(ts, vs)) / sum((t - mean_t) ** 2 for t in ts)
        return max(mean_v + slope * (tokens - mean_t), min(vs))


def model_runs(drafter: ModelDrafter, sequence: list[int], start: int) -> list[int]:
    """For each position t >= start: how many drafter predictions in a row match sequence[t:]."""
    ids = torch.tensor([sequence], device=drafter.model.device)
    with torch.inference_mode():
        logits = drafter.model(ids, use_cache=False, logits_to_keep=len(sequence) - start + 1).logits[0]
    predicted = logits[:-1].argmax(-1).tolist()  # row j predicts sequence[start + j]
    runs = [0] * (len(sequence) - start + 1)
    for j in range(len(sequence) - start - 1, -1, -1):
        runs[j] = runs[j + 1] + 1 if predicted[j] == sequence[start + j] else 0
    return runs[:-1]


def ngram_runs(drafter: NGramDrafter, sequence: list[int], start: int, k: int) -> tuple[list[int], list[int]]:
    """For each position t >= start: tokens proposed (up to k) and how many of them match."""
    proposed, runs = [], []
    for t in range(start, len(sequence)):
        draft, _ = drafter.propose(sequence[:t], k, None, None)
        n = 0
        while n < len(draft) and t + n < len(sequence) and draft[n] == sequence[t + n]:
            n += 1
        proposed.append(len(draft))
        runs.append(n)
    return proposed, runs


def replay(runs: list[int], proposed: list[int] | None, k: int, max_new_tokens: int) -> list[int]:
    """Tokens drafted in each round of a request replayed at constant K (the engine's own loop).

    Position 0 of `runs` is the first output position a round starts at (the token after the
    prefill's), i.e. output index 1.
    """
    rounds = []
    committed = 1  # output tokens after prefill
    total = len(runs) + 1
    while committed < total:
        j = committed - 1
        k_round = max(0, min(k, max_new_tokens - committed - 1, proposed[j] if proposed is not None else k))
        rounds.append(k_round)
        committed += min(runs[j], k_round) + 1
    return rounds


def batch_rounds(per_row: list[list[int]]) -> list[int]:
    """Tokens drafted per round by a batch whose rows alone would draft `per_row`: each round
    drafts as far as its longest row, and the batch lasts until its slowest row is done."""
    return [max(r[j] for r in per_row if j < len(r)) for j in range(max(map(len, per_row)))]


def drafter_runs(drafter, sequence: list[int], start: int, k: int) -> tuple[list[int], list[int] | None]:
    """(runs, tokens proposed) from every position for a model or n-gram drafter (proposed None: always k)."""
    if isinstance(drafter, NGramDrafter):
        proposed, runs = ngram_runs(drafter, sequence, start, k)
        return runs, proposed
    return model_runs(drafter, sequence, start), None


def replay_arm(engine: SpeculativeEngine, arm: Arm, prompt: list[int], output: list[int],
               max_new_tokens: int) -> list[int]:
    """Tokens drafted per round had `arm` served this greedy request (one entry per round)."""
    runs, proposed = drafter_runs(engine.drafters[arm.drafter], prompt + output, len(prompt) + 1, arm.k)
    return replay(runs, proposed, arm.k, max_new_tokens)


def arm_rewards(engine: SpeculativeEngine, arms: list[Arm], costs: CostModel,
                requests: list[tuple[list[int], list[int], int]], prefill_s: float,
                off_step_s: float) -> dict[str, float]:
    """Estimated reward (OFF time / arm time) of each arm whose costs are known.

    `requests` holds (prompt, output, max_new_tokens) of one request, or of every request of a
    batch served together: a batch's round drafts as many tokens as its longest row does and
    lasts until its slowest row is done, at the costs measured at the batch's load.
    """
    requests = [r for r in requests if len(r[1]) >= 2]
    if not requests:
        return {}
    off_rounds = max(len(output) for _, output, _ in requests) - 1
    off_time = prefill_s + off_rounds * off_step_s
    known = [a for a in arms if a.is_off or costs.draft_cost(a.drafter) is not None]  # others never served yet
    longest = {}  # drafter -> its largest K: shorter K replay the same runs
    for arm in known:
        if not arm.is_off and isinstance(engine.drafters.get(arm.drafter), (ModelDrafter, NGramDrafter)):
            longest[arm.drafter] = max(longest.get(arm.drafter, 0), arm.k)
    sequences = [prompt + output for prompt, output, _ in requests]
    starts = [len(prompt) + 1 for prompt, _, _ in requests]
    run_table = {name: [drafter_runs(engine.drafters[name], sequence, start, k)
                        for sequence, start in zip(sequences, starts)] for name, k in longest.items()}
    estimates = {}
    for arm in known:
        if arm.is_off:
            rounds = [0] * off_rounds
        elif arm.drafter in run_table:
            per_row = [replay(runs, proposed, arm.k, max_new)
                       for (runs, proposed), (_, _, max_new) in zip(run_table[arm.drafter], requests)]
            rounds = batch_rounds(per_row)
        else:
            continue
        verify = [costs.verify_cost(k + 1) for k in rounds]
        if any(v is None for v in verify):
            continue
        draft = (costs.draft_cost(arm.drafter) or 0.0) * sum(rounds) if not arm.is_off else 0.0
        estimates[str(arm)] = off_time / (prefill_s + draft + sum(verify))
    return estimates
