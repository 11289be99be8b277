"""UCB and Thompson sampling over arms, per request class and load bucket.

Reward is goodput relative to the class's OFF baseline. Every update discounts all arms of
its key (gamma), so old evidence fades and the policy follows drift; an arm that went
unpulled grows uncertain and gets probed again. Classes share what they learn: every decision
sees each arm's statistics shrunk toward what the other classes at the same load predict for
this class (a few pseudo-observations), from a model of each class's mean reward on each arm
as the class's level (how far speculation goes on its text) times the arm's effect
(`fit_levels`), so an arm first measured in a hard class is not taken for a slow arm
everywhere, an arm that is slow everywhere is not explored from scratch in every class, and a
class's own data soon outweighs the others'. The OFF guard sends a class to OFF once its best
speculative arm is confidently slower than OFF, and still probes rarely so the class can come
back. Exploration is conservative (Wu et al. 2016, "Conservative Bandits"): a key plays an
uncertain arm only while its discounted earnings over OFF cover that arm's pessimistic
outcome, so a key where speculation loses (a class under load, where the verify costs every
row of the batch) cannot spend many requests finding that out, and one where it wins
explores freely.
"""

from __future__ import annotations

import math
import random
from collections import Counter

from engine import OFF, Arm
from policies.base import LOAD_BUCKETS, Context, Outcome, Policy

PRIOR_VARIANCE = 0.25  # reward variance assumed before an arm has data (reward ~ 1 +- 0.5)
LEVELS_KEY = "__load_levels__"  # the state's policy-wide entry: each load's fitted arm effects


def _load_of(key: str) -> str:
    """The load bucket part of a key ("code@load5+" -> "load5+"; "" for a key without one)."""
    return key.partition("@")[2]


class ArmTable:
    """Discounted count, sum and sum of squares of rewards for each arm of one key."""

    def __init__(self, arms: list[str], rows: dict | None = None) -> None:
        self.rows = {a: [0.0, 0.0, 0.0] for a in arms}
        self.counts = dict.fromkeys(arms, 0)  # real pulls, undiscounted (priors excluded)
        self.pulls = 0
        self.margin = 0.0  # discounted sum of (reward - (1 - safety)) over real pulls (see _affordable)
        self.guarded = False
        if rows:
            self.rows.update({a: list(v) for a, v in rows.items() if a in self.rows})

    def n(self, arm: str) -> float:
        return self.rows[arm][0]

    def mean(self, arm: str, default: float = 1.0) -> float:
        n, s, _ = self.rows[arm]
        return s / n if n > 1e-9 else default

    def pooled_variance(self) -> float:
        """Noise level of rewards in this key, pooled over arms (stabler than per arm)."""
        n_all = sum(r[0] for r in self.rows.values())
        if n_all < 2:
            return PRIOR_VARIANCE
        within = sum(max(0.0, ss - s * s / n) for n, s, ss in self.rows.values() if n > 1e-9)
        return max(within / max(n_all - 1, 1.0), 1e-4)

    def update(self, arm: str, reward: float, discount: float, siblings: dict | None = None) -> None:
        for row in self.rows.values():
            row[0] *= discount
            row[1] *= discount
            row[2] *= discount
        self._add(arm, reward, 1.0)
        for sibling, (estimate, weight) in (siblings or {}).items():
            if sibling in self.rows:
                self._add(sibling, estimate, weight)
        self.counts[arm] += 1
        self.pulls += 1

    def _add(self, arm: str, reward: float, weight: float) -> None:
        row = self.rows[arm]
        row[0] += weight
        row[1] += weight * reward
        row[2] += weight * reward * reward

    def to_dict(self) -> dict:
        return {"rows": self.rows, "counts": self.counts, "pulls": self.pulls, "margin": self.margin,
                "guarded": self.guarded}

    @classmethod
    def from_dict(cls, arms: list[str], state: dict) -> ArmTable:
        table = cls(arms, state.get("rows"))
        table.counts.update({a: int(c) for a, c in state.get("counts", {}).items() if a in table.counts})
        table.pulls = int(state.get("pulls", 0))
        table.margin = float(state.get("margin", 0.0))
        table.guarded = bool(state.get("guarded", False))
        return table


def fit_levels(tables: list[ArmTable], iterations: int = 8,
               offsets: list[dict[str, float]] | None = None) -> tuple[dict[str, float], float]:
    """Each speculative arm's effect, and the keys' mean level, in a model of every key's mean
    reward on every arm as its level times the arm's effect (additive in logs), fitted to the
    keys' evidence by alternating weighted means (each cell weighted by its count).

    A class's level is how far speculation goes on its text, and raw means shared between classes
    carry it: an arm first played in an easy class looks better than one first played in a hard
    class, whatever the arms are worth. Classes share arms the replays estimate in all of them,
    which tie their levels together. OFF is left out: its reward is 1 at every level. `offsets`: per
    table, a part of each arm's mean (in logs) to take out before fitting (`BanditPolicy._carried`).

    Each effect is shrunk toward none by the number of keys behind it, keys / (keys + 1): an
    arm measured in one key carries that key's affinity for its drafter."""
    cells = []
    for i, table in enumerate(tables):
        offset = offsets[i] if offsets is not None else {}
        cell = {a: (n, math.log(max(s / n, 1e-6)) - offset.get(a, 0.0)) for a, (n, s, _) in table.rows.items()
                if a != str(OFF) and n > 1e-9}
        if cell:
            cells.append(cell)
    if not cells:
        return {}, 0.0
    levels = [sum(n * v for n, v in cell.values()) / sum(n for n, _ in cell.values()) for cell in cells]
    effects: dict[str, float] = {}
    keys = Counter(arm for cell in cells for arm in cell)
    for _ in range(iterations):
        weighted, counts = {}, {}
        for cell, level in zip(cells, levels):
            for arm, (n, v) in cell.items():
                weighted[arm] = weighted.get(arm, 0.0) + n * (v - level)
                counts[arm] = counts.get(arm, 0.0) + n
        effects = {arm: weighted[arm] / counts[arm] * keys[arm] / (keys[arm] + 1.0) for arm in weighted}
        levels = [sum(n * (v - effects[a]) for a, (n, v) in cell.items()) / sum(n for n, _ in cell.values())
                  for cell in cells]
    evidence = [sum(n for n, _ in cell.values()) for cell in cells]
    return effects, sum(w * level for w, level in zip(evidence, levels)) / sum(evidence)


def key_level(table: ArmTable | None, effects: dict[str, float], mean_level: float,
              offset: dict[str, float] | None = None) -> float:
    """A key's level in logs under `fit_levels`' model: its mean log reward less each arm's effect
    (and `offset`, a part of each arm's mean taken out as in the fit), weighted by evidence; the
    keys' `mean_level` where it has none on the fitted arms."""
    offset = offset or {}
    own = [(n, math.log(max(s / n, 1e-6)) - effects[a] - offset.get(a, 0.0))
           for a, (n, s, _) in table.rows.items() if a in effects and n > 1e-9] if table is not None else []
    return sum(n * v for n, v in own) / sum(n for n, _ in own) if own else mean_level


class LoadTotals:
    """Each arm's count and sum of rewards, and the sum of pooled variances, over every key at one load.

    A decision needs the other keys' evidence at its load: it subtracts its own key from these.
    They are kept up to date as keys change (an update takes its key's sums out and puts the
    new ones in, O(arms)), and summed afresh once as many updates as there were keys at the
    last fit have gone by, so rounding cannot pile up, and a stream of new keys (each one
    update old) does not go on being seeded from a fit of the first few. Summed afresh at every
    update, they would cost O(keys x arms) on every request's path.
    """

    def __init__(self, tables: list[ArmTable], arms: list[str]) -> None:
        self.n = {a: sum(t.rows[a][0] for t in tables) for a in arms}
        self.s = {a: sum(t.rows[a][1] for t in tables) for a in arms}
        self.variance = sum(t.pooled_variance() for t in tables)
        self.keys = len(tables)
        self.fitted_keys = len(tables)  # the keys behind `effects`
        self.changes = 0  # updates taken in since summed afresh
        # Fitted when summed afresh only: O(keys x arms) each time, O(arms) an update on average.
        self.effects, self.mean_level = fit_levels(tables)
        # another load -> this load's effects and mean level with each class's offsets there
        # taken out (`BanditPolicy._carried`), as fitted
        self.carried_fits: dict[str, tuple[dict[str, float], float]] = {}

    def fit_state(self) -> dict:
        """The fit and how far it is from the next one: with the keys, what the shared evidence in
        the next decisions depends on."""
        return {"effects": self.effects, "mean_level": self.mean_level, "changes": self.changes,
                "fitted_keys": self.fitted_keys,
                "carried_fits": self.carried_fits}

    def restore_fit(self, saved: dict) -> None:
        self.effects = {arm: float(v) for arm, v in saved.get("effects", {}).items()}
        self.mean_level = float(saved.get("mean_level", 0.0))
        self.changes = int(saved.get("changes", 0))
        self.fitted_keys = int(saved.get("fitted_keys", self.keys))
        self.carried_fits = {load: ({arm: float(v) for arm, v in effects.items()}, float(mean_level))
                             for load, (effects, mean_level) in saved.get("carried_fits", {}).items()}

    def add(self, table: ArmTable, sign: float = 1.0) -> None:
        """Put a key's sums in (sign -1: take them out); the count of keys is the caller's."""
        for arm, (n, s, _) in table.rows.items():
            self.n[arm] += sign * n
            self.s[arm] += sign * s
        self.variance += sign * table.pooled_variance()

    def means(self) -> dict[str, float]:
        """Each arm's mean over the keys (arms with evidence)."""
        return {arm: self.s[arm] / n for arm, n in self.n.items() if n > 1e-9}

    def level(self, table: ArmTable | None) -> float:
        """The key's level in logs (`fit_levels`): from its own evidence, else the keys' mean."""
        return key_level(table, self.effects, self.mean_level)

    def leveled(self, table: ArmTable, means: dict[str, float]) -> dict[str, float]:
        """`means` with each speculative arm's replaced by what `fit_levels`' model predicts for
        `table`'s key: its level (from its own evidence, else the keys' mean) times the arm's effect."""
        level = self.level(table)
        return {arm: math.exp(level + self.effects[arm]) if arm in self.effects else mean
                for arm, mean in means.items()}

    def affinities(self, table: ArmTable, drafter_of: dict[str, str]) -> dict[str, float]:
        """How far the key's rewards ran above (or below) the model's prediction for it on each
        drafter's arms, in logs: which drafter drafts its text well, beyond what its level and the
        arms' effects say (the code head on code, the prose head on prose). Shrunk toward none by
        one pseudo-observation, so one replay says little."""
        level, sums = self.level(table), {}
        for arm, (n, s, _) in table.rows.items():
            if arm in self.effects and n > 1e-9:
                weight, total = sums.get(drafter_of[arm], (0.0, 0.0))
                residual = math.log(max(s / n, 1e-6)) - level - self.effects[arm]
                sums[drafter_of[arm]] = (weight + n, total + n * residual)
        return {drafter: total / (weight + 1.0) for drafter, (weight, total) in sums.items()}

    def evidence_without(self, table: ArmTable) -> dict[str, float]:
        """The other keys' (discounted) count of rewards per arm."""
        return {arm: max(0.0, self.n[arm] - n) for arm, (n, _, _) in table.rows.items()}

    def without(self, table: ArmTable) -> tuple[dict[str, float], float | None]:
        """The other keys' mean per arm (arms with evidence) and their mean variance (None: no other key)."""
        means = {}
        for arm, (n, s, _) in table.rows.items():
            rest = self.n[arm] - n
            if rest > 1e-9 * max(1.0, self.n[arm]):  # relative: what is left of rounding is no evidence
                means[arm] = (self.s[arm] - s) / rest
        if self.keys <= 1:
            return means, None
        return means, (self.variance - table.pooled_variance()) / (self.keys - 1)


class BanditPolicy(Policy):
    learns = True

    def __init__(
        self,
        arms: list[Arm],
        discount: float = 0.99,
        prior_weight: float = 2.0,
        share_weight: float = 2.0,
        guard: bool = True,
        guard_z: float = 1.0,
        probe_rate: float = 0.05,
        safety: float | None = 0.02,
        replay_z: float = 2.0,
        seed: int = 0,
    ) -> None:
        super().__init__(arms)
        self.arm_names = [str(a) for a in self.arms]
        self.by_name = {str(a): a for a in self.arms}
        self._drafters = {str(a): a.drafter for a in self.arms}
        self.discount = discount
        self.prior_weight = prior_weight
        self.share_weight = share_weight
        self.guard = guard
        self.guard_z = guard_z
        self.probe_rate = probe_rate
        self.safety = safety  # None: unconstrained exploration
        self.replay_z = replay_z
        self.rng = random.Random(seed)
        self.tables: dict[str, ArmTable] = {}
        self.priors: dict[str, dict[str, tuple[float, float]]] = {}  # class -> arm -> (mean, weight)
        self._totals: dict[str, LoadTotals] = {}  # load -> totals over its keys; dropped when one changes

    # ----- priors -------------------------------------------------------------------------
    def set_prior(self, request_class: str, priors: dict[str, tuple[float, float]]) -> None:
        """Seed a class from an offline study: {arm: (mean reward, pseudo-count)}."""
        self.priors[request_class] = priors

    def _new_table(self, context: Context) -> ArmTable:
        table = ArmTable(self.arm_names)
        explicit = self.priors.get(context.request_class)
        if explicit:
            source, variance = explicit, PRIOR_VARIANCE
        elif self._load_totals(_load_of(context.key)).keys:
            # Costs follow the load, acceptance the class: other classes at this load are added at
            # each decision (`_with_shared_prior`), fading as this key's own evidence grows.
            return table
        else:
            same_class = [t for k, t in self.tables.items() if k.split("@")[0] == context.request_class]
            tables = same_class or list(self.tables.values())
            source = self._pooled(tables)
            variance = sum(t.pooled_variance() for t in tables) / len(tables) if tables else PRIOR_VARIANCE
        for arm, (mean, weight) in source.items():
            if arm in table.rows and weight > 0:
                # Pseudo-observations at the prior mean, spread like the source's rewards.
                table.rows[arm] = [weight, mean * weight, weight * (mean * mean + variance)]
        return table

    def _pooled(self, tables: list[ArmTable]) -> dict[str, tuple[float, float]]:
        pooled = {}
        for arm in self.arm_names:
            n = sum(t.n(arm) for t in tables)
            if n > 1e-9:
                pooled[arm] = (sum(t.rows[arm][1] for t in tables) / n, self.prior_weight)
        return pooled

    def table(self, context: Context) -> ArmTable:
        if context.key not in self.tables:
            totals = self._load_totals(_load_of(context.key))  # the others', before this key joins
            table = self.tables[context.key] = self._new_table(context)
            totals.add(table)
            totals.keys += 1
        return self.tables[context.key]

    def _load_totals(self, load: str) -> LoadTotals:
        if load not in self._totals:
            tables = [t for k, t in self.tables.items() if _load_of(k) == load]
            self._totals[load] = LoadTotals(tables, self.arm_names)
        return self._totals[load]

    def _with_shared_prior(self, context: Context, table: ArmTable) -> ArmTable:
        """A copy of `table` plus pseudo-observations of what the other classes suggest for each arm.

        `share_weight` of them while the class has no evidence of its own on an arm, fading as
        its own grows (w^2 / (w + n)): a fixed share kept an arm that is best elsewhere but loses
        here (n-gram lookup on text sampled at T=1) in play long after the class had measured it.
        Never more than the other classes' own evidence on the arm: with 43 arms and 13 classes of
        8 requests, one request's reward on a hybrid, shared at full weight, made every class as
        sure of it as of arms measured dozens of times, and ucb never played it again although it
        was the fastest arm.
        """
        totals = self._load_totals(_load_of(context.key))
        others, variance = totals.without(table)
        # The class's own evidence at another load goes over any prediction from other classes
        means = self._shared_means(context, totals.leveled(table, others)) | self._carried(context, table)
        if not means or self.share_weight <= 0:
            return table
        view = ArmTable(self.arm_names, table.rows)
        view.counts, view.pulls = table.counts, table.pulls
        variance = table.pooled_variance() if variance is None else variance
        evidence = totals.evidence_without(table)
        for arm, mean in means.items():
            share = min(self.share_weight, evidence.get(arm, self.share_weight))
            if share <= 0:
                continue
            weight = share ** 2 / (share + table.n(arm))
            view._add(arm, mean, weight)
            view.rows[arm][2] += weight * variance  # spread like the others' rewards
        return view

    def _carried(self, context: Context, table: ArmTable) -> dict[str, float]:
        """What the class's evidence at another load (the one with the most) says of its arms here.

        Acceptance follows the class's text and costs the load, so each key's mean reward on an
        arm is modelled as its level times the arm's effect at the key's load times the class's
        offset, whatever the load: how far its level and its affinity for the arm's drafter ran
        from the mean class's at the other load (`_class_offsets`; the code head on code, the
        prose head on prose). This load's effects are fitted over its keys with their classes'
        offsets taken out, so that what one class's text favours is not taken for what the load does.
        A class's first bursts of 16 otherwise played what the other classes' bursts favoured
        (the code head's hybrid for math, whose drafts the prose head makes; speculation for
        chat, whose bursts run fastest OFF). The load's effect is fitted over every key at the
        load, not taken from each class's change between the loads, which one request alone
        against a burst of other prompts misstates."""
        request_class, _, here = context.key.partition("@")
        there = max((f"load{bucket}" for bucket in LOAD_BUCKETS if f"load{bucket}" != here),
                    key=lambda load: self._evidence(self.tables.get(f"{request_class}@{load}")))
        elsewhere = self.tables.get(f"{request_class}@{there}")
        if elsewhere is None:
            return {}
        totals = self._load_totals(here)
        if there not in totals.carried_fits:
            keys = [(k, t) for k, t in self.tables.items() if _load_of(k) == here]
            offsets = [self._class_offsets(k.partition("@")[0], there) for k, _ in keys]
            totals.carried_fits[there] = fit_levels([t for _, t in keys], offsets=offsets)
        effects, mean_level = totals.carried_fits[there]
        offset = self._class_offsets(request_class, there)
        level = key_level(table, effects, mean_level, offset)
        return {arm: math.exp(level + effect + offset[arm]) for arm, effect in effects.items() if arm in offset}

    def _class_offsets(self, request_class: str, load: str) -> dict[str, float]:
        """How far the class's rewards at `load` ran from the mean key's there on each arm, in logs:
        its level over the keys' mean level, plus its affinity for the arm's drafter ({}: no
        evidence there). Shrunk toward the mean key by `prior_weight` requests, since a request's
        replays all read one prompt, and one hard prompt would carry every class after it too
        high."""
        table = self.tables.get(f"{request_class}@{load}")
        if table is None:
            return {}
        totals = self._load_totals(load)
        shrink = table.pulls / (table.pulls + self.prior_weight)
        level = totals.level(table) - totals.mean_level
        by_drafter = totals.affinities(table, self._drafters)
        return {arm: shrink * (level + by_drafter[drafter]) for arm, drafter in self._drafters.items()
                if drafter in by_drafter}

    @staticmethod
    def _evidence(table: ArmTable | None) -> float:
        return sum(n for n, _, _ in table.rows.values()) if table is not None else 0.0

    def _shared_means(self, context: Context, others: dict[str, float]) -> dict[str, float]:
        """Each arm's mean over the other classes at the same load (`others`): under load the
        extra verify tokens cost more, so load-1 means would mislead."""
        return others

    # ----- decisions ----------------------------------------------------------------------
    def choose(self, context: Context) -> Arm:
        table = self.table(context)
        view = self._with_shared_prior(context, table)
        guarded = self._guard(view)
        table.guarded = view.guarded
        arm = guarded if guarded is not None else self.by_name[self._next(view)]
        if self.safety is None or arm.is_off or self._affordable(table, view, str(arm)):
            return arm
        # Not affordable: the safest play, the arm whose pessimistic reward is highest (OFF's is 1),
        # by the key's own evidence (its rewards and replays) spread as the view's. The other
        # classes' evidence says what to try, not what is safe here: mixed in, it can hold an arm
        # the key's replays found fast under OFF while OFF repays a loss at only `safety` a request.
        sd = math.sqrt(view.pooled_variance())
        safest = max(self.arm_names, key=lambda a: 1.0 if a == str(OFF) else self._lower(table, a, sd))
        return self.by_name[safest]

    def worth_replaying(self, context: Context) -> list[Arm]:
        """OFF, and every arm that could still be the key's best: no evidence yet, or an upper
        bound (`replay_z` standard errors, wider than the guard's) at least the best mean. A
        replay costs a teacher-forced forward per drafter model, not worth paying for arms every
        class has found slower."""
        view = self._with_shared_prior(context, self.table(context))
        sd = math.sqrt(view.pooled_variance())
        known = [a for a in self.arm_names if view.n(a) > 1e-9]
        best = max((view.mean(a) for a in known), default=1.0)
        return [self.by_name[a] for a in self.arm_names
                if a == str(OFF) or view.n(a) < 1e-9
                or view.mean(a) + self.replay_z * sd / math.sqrt(view.n(a)) >= best]

    def _lower(self, view: ArmTable, arm: str, sd: float) -> float:
        """The arm's lower confidence bound; an arm with no evidence is taken to lose at most `safety`."""
        n = view.n(arm)
        if n < 1e-9:
            return 1.0 - self.safety
        return view.mean(arm) - self.guard_z * sd / math.sqrt(n)

    def _affordable(self, table: ArmTable, view: ArmTable, arm: str) -> bool:
        """Conservative exploration: playing `arm` keeps the key at >= (1 - safety) of OFF even if
        the arm returns its lower confidence bound, or the arm is at least as safe as OFF.

        An arm with no evidence is tried while the margin is not negative, so a fresh
        controller explores from its first requests, and a key that has lost explores uncertain
        arms again only once safe plays have paid the loss back (OFF earns `safety` a request;
        an arm confidently faster than OFF earns more, so a class misled by the others'
        evidence into a few losses goes on to the arm its replays favour, not to OFF). The
        margin is discounted like the evidence, so old gains do not license new losses for ever.
        """
        lower = self._lower(view, arm, math.sqrt(view.pooled_variance()))
        return lower >= 1.0 or table.margin + lower - (1.0 - self.safety) >= 0.0

    def _guard(self, table: ArmTable) -> Arm | None:
        """OFF (or, at `probe_rate`, the best speculative arm) where the guard holds the key at OFF."""
        best = self._guarded_best(table)
        table.guarded = best is not None
        if best is None:
            return None
        return self.by_name[best] if self.rng.random() < self.probe_rate else OFF

    def _guarded_best(self, table: ArmTable) -> str | None:
        """The best speculative arm where even its upper bound is slower than OFF; else None."""
        if not self.guard:
            return None
        spec = [a for a in self.arm_names if a != str(OFF)]
        if not spec or any(table.n(a) < 1e-9 for a in spec):
            return None  # not every arm has evidence yet
        sd = math.sqrt(table.pooled_variance())
        best = max(spec, key=table.mean)
        upper = table.mean(best) + self.guard_z * sd / math.sqrt(table.n(best))
        return best if upper < table.mean(str(OFF)) else None

    def _next(self, view: ArmTable) -> str:
        """The arm to play where the guard does not decide: an arm nothing has estimated yet
        (`_first_try`; not OFF, whose reward is 1 by definition); on a key's first request the
        arm the other keys' evidence favours, without exploring (a bonus there plays whichever
        arm the others know least); else the policy's `_pick`."""
        untried = [a for a in self.arm_names if view.n(a) < 1e-9 and a != str(OFF)]
        if untried:
            return self._first_try(untried)
        if not view.pulls:
            return max(self.arm_names, key=view.mean)
        return self._pick(view)

    def _first_try(self, untried: list[str]) -> str:
        """The next untried arm: the first untried drafter at its middle untried K. Its request
        estimates the drafter's other Ks (`sibling_rewards`): exactly below its K, by
        extrapolating its acceptance above. Tried at K=1 first, a hybrid's lookups, which pay by
        drafting long runs, would show nothing of it."""
        drafter = self.by_name[untried[0]].drafter
        same = sorted((a for a in untried if self.by_name[a].drafter == drafter), key=lambda a: self.by_name[a].k)
        return same[len(same) // 2]

    def _pick(self, table: ArmTable) -> str:
        """The policy's choice once every arm but OFF has evidence (OFF's mean is 1 without any)."""
        raise NotImplementedError

    def update(self, context: Context, arm: Arm, outcome: Outcome) -> None:
        table = self.table(context)
        load = _load_of(context.key)
        totals = self._load_totals(load)
        totals.add(table, -1.0)
        table.update(str(arm), outcome.reward, self.discount, outcome.siblings)
        totals.add(table)
        totals.changes += 1
        if totals.changes >= max(1, totals.fitted_keys):
            del self._totals[load]  # summed afresh (`_load_totals`)
        if self.safety is not None:
            # OFF is the baseline: it earns exactly `safety`, whatever noise its own timing had.
            earned = 1.0 if arm.is_off else outcome.reward
            table.margin = table.margin * self.discount + earned - (1.0 - self.safety)
        self._load_totals(load)  # if summed afresh, now: after the request was served, not in the next decision
        # Whether the guard holds the key at OFF, as the next decision will find it: part of what
        # was learned, so a fold of the journal (learning.py) and `inspect` see it too.
        table.guarded = self._guarded_best(self._with_shared_prior(context, table)) is not None

    # ----- persistence --------------------------------------------------------------------
    def state_dict(self) -> dict[str, dict]:
        state = {key: table.to_dict() for key, table in self.tables.items()}
        # A new key's prior comes from its load's arm effects as last fitted, and they are
        # refitted every so many updates: saved, so that a policy resumed from this state seeds
        # new keys as the one that saved it would have (a fold of the journal from a checkpoint
        # then learns what the whole fold learns, learning.py), not from effects fitted afresh.
        state[LEVELS_KEY] = {load: totals.fit_state() for load, totals in self._totals.items()}
        return state

    def load_state_dict(self, state: dict[str, dict]) -> None:
        state = dict(state)
        levels = state.pop(LEVELS_KEY, {})
        self.tables = {key: ArmTable.from_dict(self.arm_names, table_state) for key, table_state in state.items()}
        self._totals.clear()
        for load, saved in levels.items():
            self._load_totals(load).restore_fit(saved)


class UCBPolicy(BanditPolicy):
    """Upper confidence bound with the key's pooled reward noise as the scale.

    exploration 0.5 rather than the textbook 1: most of the reward noise is the prompt, shared
    by all arms, and counterfactual estimates already score the arms not played.
    """

    name = "ucb"

    def __init__(self, arms: list[Arm], exploration: float = 0.5, **kw) -> None:
        super().__init__(arms, **kw)
        self.exploration = exploration

    def _pick(self, table: ArmTable) -> str:
        sd = math.sqrt(table.pooled_variance())
        total = sum(table.n(a) for a in self.arm_names)
        log_term = 2.0 * math.log(max(total, 2.0))

        def score(arm: str) -> float:
            if table.n(arm) < 1e-9:  # OFF, never played
                return table.mean(arm)
            return table.mean(arm) + self.exploration * sd * math.sqrt(log_term / table.n(arm))

        return max(self.arm_names, key=score)


class ThompsonPolicy(BanditPolicy):
    """Gaussian Thompson sampling: draw each arm's mean from its posterior, play the best.

    The posterior's spread is scaled by `spread` (0.5), as ucb's bonus is by its exploration,
    and for the same reason: most of the reward noise is the prompt, shared by all arms, so
    the pooled variance overstates how uncertain one arm is against another. Chapelle and Li
    (2011, "An Empirical Evaluation of Thompson Sampling") found such a narrower posterior
    better in practice. At full spread, with 43 arms and 8 requests a class, the many-classes
    bench's thompson played 18-25 arms in 104 requests and served chat and structured markup on
    model drafters while exploring; at half, 10-15 arms.
    """

    name = "thompson"

    def __init__(self, arms: list[Arm], spread: float = 0.5, **kw) -> None:
        super().__init__(arms, **kw)
        self.spread = spread

    def _pick(self, table: ArmTable) -> str:
        sd = self.spread * math.sqrt(table.pooled_variance())

        def draw(arm: str) -> float:
            n = table.n(arm)
            if n < 1e-9:  # OFF, never played
                return table.mean(arm)
            return self.rng.gauss(table.mean(arm), sd / math.sqrt(n))

        return max(self.arm_names, key=draw)
