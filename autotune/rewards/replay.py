"""What every other arm would have done on a request just served.

Each replayable drafter says how far its drafts would have been kept from every position of
the served sequence (`replay_chains`, engine/replay.py: exact when greedy, in expectation when
sampled). Replaying the decode loop over those chains gives each arm's rounds and drafted
tokens; the measured costs (rewards/costs.py) turn them into time. The result is a paired
estimate of every arm's reward on the same request, so a policy compares arms without the
noise of comparing different prompts. Sampled probabilities are taken along the output
actually sampled rather than along each arm's own drafts, so there the replay is an
approximation (a test bounds its error).
"""

from __future__ import annotations

import functools

import torch

from autotune.rewards.costs import NO_MODEL, CostModel
from autotune.rewards.siblings import kept_survival
from engine import Arm, SamplingParams, SpeculativeEngine
from engine.coupled import replay_noise
from engine.drafters import capabilities, lookup_of, model_drafter_of
from engine.feature import Features, feature_head_of
from engine.replay import ReplayChains, ReplayInputs, lookup_chains, teacher_forced_logits
from engine.sampling import probabilities


def target_probabilities(engine: SpeculativeEngine, sequence: list[int], start: int,
                         sampling: SamplingParams) -> torch.Tensor:
    """[len(sequence) - start, V]: the distribution each output token from `start` on was sampled
    from, min_tokens included (the output begins one token before `start`)."""
    hold = engine.stopping(sampling, start - 1).hold
    return probabilities(teacher_forced_logits(engine.target, sequence, start, sampling, hold), sampling)


def expected_accepted(chain: list[float], k: int) -> float:
    """Drafts kept in a round of k drafts: each is kept only if every earlier one was."""
    kept, alive = 0.0, 1.0
    for accept in chain[:k]:
        alive *= accept
        kept += alive
    return kept


def replay(chains: list[list[float]], proposed: list[int] | None, k: int, max_new_tokens: int) -> list[int]:
    """Tokens drafted in each round of a request replayed at constant K (the engine's own loop)."""
    return [drafted for _, drafted in replay_rounds(chains, proposed, k, max_new_tokens)]


def replay_rounds(chains: list[list[float]], proposed: list[int] | None, k: int,
                  max_new_tokens: int) -> list[tuple[int, int]]:
    """(position of `chains` it starts at, tokens drafted) of each round of a request replayed at
    constant K (the engine's own loop).

    Position 0 of `chains` is the first output position a round starts at (the token after the
    prefill's), i.e. output index 1. A sampled replay advances by expected, fractional amounts.
    """
    rounds = []
    committed = 1.0  # output tokens after prefill
    # The round starts at output index int(committed). Probabilities that should sum to 1 are
    # float32 and fall short by up to ~3e-7 per draft, so a run of certain drafts can total a
    # hair under a whole token; the tolerance covers thousands of drafts of that.
    while (j := int(committed + 1e-3) - 1) < len(chains):
        k_round = max(0, min(k, max_new_tokens - j - 2, proposed[j] if proposed is not None else k))
        rounds.append((j, k_round))
        committed += expected_accepted(chains[j], k_round) + 1
    return rounds


def batch_rounds(per_row: list[list[int]]) -> list[int]:
    """Tokens drafted per round by a batch whose rows alone would draft `per_row`: each round
    drafts as far as its longest row, and the batch lasts until its slowest row is done."""
    return [max(r[j] for r in per_row if j < len(r)) for j in range(max(map(len, per_row)))]


def drafter_chains(drafter, inputs: ReplayInputs) -> ReplayChains | None:
    """How far `drafter`'s drafts would have been kept from every position of a served sequence;
    None for a drafter that does not declare `Capabilities(replay=True)` or cannot replay this
    request (a feature head where the request edits its logits)."""
    return drafter.replay_chains(inputs) if replayable(drafter) else None


def kept_chain(metrics, k: int, depth: int) -> list[float] | None:
    """A request's drafts kept per position as a chain of `depth` acceptance probabilities: the
    chance that draft i is kept once every earlier one was, from its rounds at constant K = `k`
    (`accepted_per_position` over every round, drafted that far or not), the fall past K
    extended geometrically as `sibling_rewards` does; None if its first drafts were never kept."""
    survival = kept_survival(metrics, k)
    if survival is None:
        return None
    chain = [survival[0]] + [b / a if a > 0 else 0.0 for a, b in zip(survival, survival[1:])]
    return chain + [chain[-1]] * (depth - len(chain))


def hybrid_rounds(chain: list[float], proposed: list[int], looked_up: list[list[float]], k: int,
                  max_new_tokens: int) -> list[tuple[int, bool]]:
    """(tokens drafted, by lookup) of each round of a hybrid at constant K whose lookup proposes
    `proposed[j]` tokens from output position j (kept as `looked_up[j]` says: `lookup_chains`) and
    whose inner drafter's drafts are kept as `chain` says (`kept_chain`) wherever it proposes none."""
    chains = [looked_up[j] if n else chain for j, n in enumerate(proposed)]
    return [(drafted, proposed[j] > 0)
            for j, drafted in replay_rounds(chains, [n or k for n in proposed], k, max_new_tokens)]


def hybrid_estimates(engine: SpeculativeEngine, arm: Arm, metrics, reward: float, prompt: list[int],
                     output: list[int], max_new_tokens: int, costs: CostModel, ks: dict[str, list[int]],
                     exact_weight: float = 0.5, extrapolated_weight: float = 0.25) -> dict[str, tuple[float, float]]:
    """Estimated rewards {arm: (reward, weight)} of the hybrids that chain a lookup before the
    drafter of `arm` (`ks`: the K values of each drafter among the policy's arms), from one
    greedy request that drafter served alone at constant K, without a forward: where the
    hybrid's lookup proposes, its drafts are kept exactly as the output says (a scan of it);
    everywhere else its inner drafter drafts, kept as often per position as in this request
    (`kept_chain`). Both arms' rounds are priced with the same measured costs and the hybrid's
    time scaled by what this request's own rounds took over their price, so the estimate moves
    with the served arm's reward; without it a policy learns a hybrid only by playing it. Ks
    above the served one extrapolate its chain: less weight."""
    hybrids = {name: hybrid_ks for name, hybrid_ks in ks.items()
               if name != arm.drafter and lookup_of(engine.drafters[name]) is not None
               and draft_cost_owner(engine, name) == arm.drafter}
    if arm.is_off or not hybrids or lookup_of(engine.drafters[arm.drafter]) is not None or len(output) < 2:
        return {}
    depth = max(max(hybrid_ks) for hybrid_ks in hybrids.values())
    chain = kept_chain(metrics, arm.k, depth)
    if chain is None:
        return {}

    # Every K's rounds ask for the same few costs: a median each
    draft_cost, verify_cost = functools.cache(costs.draft_cost), functools.cache(costs.verify_cost)

    def seconds(rounds: list[tuple[int, bool]], who: str, lookup: str | None) -> float | None:
        """The rounds' price: a lookup's draft (next to nothing where its drafter has not run), the
        played drafter's, and a verify after `who`'s drafts."""
        total = 0.0
        for drafted, by_lookup in rounds:
            if by_lookup:
                draft = (draft_cost(lookup, drafted) if lookup else None) or 0.0
            else:
                draft = draft_cost(arm.drafter, drafted) if drafted else 0.0
            verify = verify_cost(drafted + 1, who)
            if draft is None or verify is None:
                return None
            total += draft + verify
        return total

    positions = len(output) - 1
    served = seconds(hybrid_rounds(chain, [0] * positions, [[]] * positions, arm.k, max_new_tokens), arm.drafter,
                     None)
    if not served:
        return {}
    scale = (metrics.draft_s + metrics.verify_s) / served
    sequence, start = prompt + output, len(prompt) + 1
    estimates = {}
    for name, hybrid_ks in hybrids.items():
        looked_up, proposed = lookup_chains(lookup_of(engine.drafters[name]), sequence, start, depth, None)
        lookup, _ = hybrid_parts(engine, name)
        for k in hybrid_ks:
            hybrid = seconds(hybrid_rounds(chain, proposed, looked_up, k, max_new_tokens), name, lookup)
            if hybrid is not None:
                estimate = reward * (metrics.prefill_s + scale * served) / (metrics.prefill_s + scale * hybrid)
                estimates[f"{name}:{k}"] = (estimate, exact_weight if k <= arm.k else extrapolated_weight)
    return estimates


def served_features(drafter) -> Features | None:
    """The target's features the last request `drafter` served handed its feature head, a copy;
    None for a drafter without one."""
    head = feature_head_of(drafter)
    return head.served() if head is not None else None


def replayable(drafter) -> bool:
    """The replay can estimate `drafter`: it declares so (lookups, model drafters, feature heads, chains of them)."""
    return capabilities(drafter).replay


def hybrid_parts(engine: SpeculativeEngine, name: str) -> tuple[str | None, str] | None:
    """The engine's drafters that run what drafter `name` runs when it chains a lookup and another
    drafter: (an n-gram drafter or None, the drafter that is its inner one or runs its model,
    `draft_cost_owner`); None if `name` does not chain or no such drafter is in the engine."""
    inner = draft_cost_owner(engine, name)
    if inner == name:
        return None
    lookup = next((n for n, d in engine.drafters.items() if lookup_of(d) is not None and model_drafter_of(d) is None
                   and getattr(d, "inner", None) is None), None)
    return lookup, inner


def verify_owners(engine: SpeculativeEngine) -> dict[str, str]:
    """Whose verify costs price each of the engine's drafters': its own for a drafter that runs a
    model (its drafts evict the target's weights from the CPU caches), NO_MODEL for the others
    (lookups, feature heads, layer skips, hybrids of them), whose verifies find the target as
    OFF's do and are priced from one pooled table, steadier than a table each."""
    return {name: name if model_drafter_of(drafter) is not None else NO_MODEL
            for name, drafter in engine.drafters.items()}


def draft_cost_owner(engine: SpeculativeEngine, name: str) -> str:
    """The engine's drafter whose draft rounds cost what drafter `name`'s cost as K changes: for a
    lookup chained before an inner drafter, the drafter that is that inner one or runs its model
    (lookup rounds cost next to nothing at any K, so the hybrid's own cost per round is the share
    of its rounds that the inner drafter drafted, which depends on the text: calibrated on
    copy-heavy code it priced a hybrid's K = 8 round below its K = 6 one); else `name`."""
    drafter = engine.drafters.get(name)
    inner = getattr(drafter, "inner", None)
    if lookup_of(drafter) is None or inner is None:
        return name
    model = model_drafter_of(inner)
    for other, candidate in engine.drafters.items():
        if other != name and lookup_of(candidate) is None and (
                candidate is inner or (model is not None and getattr(model_drafter_of(candidate), "model", None)
                                       is model.model)):
            return other
    return name


def replay_arm(engine: SpeculativeEngine, arm: Arm, prompt: list[int], output: list[int], max_new_tokens: int,
               sampling: SamplingParams | None = None, features: Features | None = None) -> list[int]:
    """Tokens drafted per round had `arm` served this request (one entry per round; expected if
    sampled); `features`: see `arm_rewards`."""
    sequence, start = prompt + output, len(prompt) + 1
    noise = replay_noise(sampling, engine.device)
    target = None if sampling is None or sampling.greedy or noise is not None \
        else target_probabilities(engine, sequence, start, sampling)
    memo = {} if features is None else {"features": features}
    replayed = drafter_chains(engine.drafters[arm.drafter],
                              ReplayInputs(sequence, start, arm.k, target, sampling, engine.target, memo, noise))
    return replay(replayed.chains, replayed.proposed, arm.k, max_new_tokens)


def arm_rewards(engine: SpeculativeEngine, arms: list[Arm], costs: CostModel,
                requests: list[tuple[list[int], list[int], int]], prefill_s: float,
                off_step_s: float, sampling: SamplingParams | list[SamplingParams] | None = None,
                features: Features | None = None, replay_rows: int | None = None) -> dict[str, float]:
    """Estimated reward (OFF time / arm time) of each arm whose costs are known.

    `requests` holds (prompt, output, max_new_tokens) of one request, or of every request of a
    batch served together: a batch's round drafts as many tokens as its longest row does and
    lasts until its slowest row is done, at the costs measured at the batch's load. `prefill_s`
    is the target's prefill, which every arm pays; a drafter's own is priced from `costs`.
    `sampling`: one for every request, or one per request (a batch may mix greedy and sampled).
    `features`: the target's features a feature head was handed while the one request was
    served (`served_features`), which feature heads then replay from without a target forward.
    `replay_rows`: replay only the first this many requests of a batch (the caller puts first
    those that decide how long it lasts), all of them still counting in its OFF rounds and
    prompt tokens.

    A hybrid's rounds of one request are priced by who drafted them, at the costs of the
    engine's n-gram drafter and of the model drafter that runs its model (`hybrid_parts`): its
    own cost per round is an average over the requests it served, whose share of lookup rounds
    differs from this one's (copy-heavy code: most; chat: few).
    """
    samplings = sampling if isinstance(sampling, list) else [sampling] * len(requests)
    kept = [i for i, r in enumerate(requests) if len(r[1]) >= 2]
    requests, samplings = [requests[i] for i in kept], [samplings[i] for i in kept]
    if not requests:
        return {}
    off_rounds = max(len(output) for _, output, _ in requests) - 1
    prompt_tokens = sum(len(prompt) for prompt, _, _ in requests)
    if replay_rows is not None:
        requests, samplings = requests[:replay_rows], samplings[:replay_rows]
    off_time = prefill_s + off_rounds * off_step_s

    @functools.cache
    def draft_cost(drafter: str, k: int) -> float | None:
        """Seconds of a round, in this request's OFF steps where measured beside OFF (see CostModel)."""
        relative = costs.relative_draft_cost(drafter, k)
        return relative * off_step_s if relative is not None else costs.draft_cost(drafter, k)

    parts = {a.drafter: hybrid_parts(engine, a.drafter) for a in arms if not a.is_off}
    parts = {name: p for name, p in parts.items() if p is not None and draft_cost(p[1], 1) is not None
             and len(requests) == 1 and replayable(engine.drafters[name])}

    def priced(arm: Arm) -> bool:
        return arm.is_off or arm.drafter in parts or draft_cost(arm.drafter, arm.k) is not None

    known = [a for a in arms if priced(a)]  # others never served
    longest = {}  # drafter -> its largest K: shorter K replay the same chains
    for arm in known:
        if not arm.is_off and replayable(engine.drafters.get(arm.drafter)):
            longest[arm.drafter] = max(longest.get(arm.drafter, 0), arm.k)
    sequences = [prompt + output for prompt, output, _ in requests]
    starts = [len(prompt) + 1 for prompt, _, _ in requests]
    noises = [replay_noise(sp, engine.device) for sp in samplings]
    targets = [target_probabilities(engine, sequence, start, sp) if sp is not None and not sp.greedy and longest
               and noise is None else None for sequence, start, sp, noise in zip(sequences, starts, samplings, noises)]
    memos = [{} for _ in sequences]  # per sequence: each model's acceptances, computed once
    if features is not None and len(requests) == 1 and features.by_position.shape[0] >= len(sequences[0]) - 1:
        memos[0]["features"] = features
    chain_table = {name: [drafter_chains(engine.drafters[name],
                                         ReplayInputs(sequence, start, k, target, sp, engine.target, memo, noise))
                          for sequence, start, target, sp, memo, noise
                          in zip(sequences, starts, targets, samplings, memos, noises)]
                   for name, k in longest.items()}
    chain_table = {name: rows for name, rows in chain_table.items() if all(row is not None for row in rows)}
    # In 1-token steps, as the played arm's reward prices them: never below one (the same few widths each round)
    verify_steps = functools.cache(costs.relative_verify_cost)  # (tokens, drafter)
    estimates = {}
    for arm in known:
        if arm.is_off:
            rounds, draft = [(0, None)] * off_rounds, 0.0  # (tokens drafted, by which drafter)
        elif arm.drafter in parts and arm.drafter in chain_table:
            (lookup, model), replayed = parts[arm.drafter], chain_table[arm.drafter][0]
            chains, proposed, looked_up = replayed.chains, replayed.proposed, replayed.looked_up
            rounds = [(k, lookup if looked_up[j] else model) for j, k in replay_rounds(chains, proposed, arm.k,
                                                                                         requests[0][2])]
            draft = sum(draft_cost(who, k) or 0.0 for k, who in rounds if k and who is not None)
            draft += (costs.draft_prefill_cost(arm.drafter, prompt_tokens)
                      or costs.draft_prefill_cost(model, prompt_tokens))
        elif arm.drafter in chain_table:
            per_row = [replay(row.chains, row.proposed, arm.k, max_new)
                       for row, (_, _, max_new) in zip(chain_table[arm.drafter], requests)]
            rounds = [(k, arm.drafter) for k in batch_rounds(per_row)]
            draft = (sum(draft_cost(arm.drafter, k) for k, _ in rounds if k)
                     + costs.draft_prefill_cost(arm.drafter, prompt_tokens))
        else:
            continue
        verify = [verify_steps(k + 1, who if k else None) for k, who in rounds]
        if any(v is None for v in verify):
            continue
        estimates[str(arm)] = off_time / (prefill_s + draft + sum(v * off_step_s for v in verify))
    return estimates
