"""Drafters propose K tokens for the target to verify.

The interface is two calls, in the spirit of transformers' candidate generators:
`propose` returns draft tokens (and their distribution, if the drafter has one), and
`rollback` tells the drafter how much of what it has seen the target actually kept, so a
drafter with a KV cache trims it instead of recomputing the prefix. New drafter kinds
(early-exit self-drafting, Medusa heads, ...) implement the same protocol, in one class.

Beyond the protocol a drafter declares what else it can do (`Capabilities`) and implements
what it declares: with `batch`, `for_batch` gives its drafting for the rows of a batch
(`BatchDrafting`); with `replay`, `replay_chains` says how far its drafts would have been kept
along a served sequence (engine/replay.py). The batch and the controller's replay call those
methods and never ask a drafter its type.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import PreTrainedModel

from engine.replay import ReplayChains, ReplayInputs, lookup_chains, model_chains
from engine.round import Drafts, Row
from engine.runner import ModelRunner
from engine.sampling import Randomness, SamplingParams, draft_token


@dataclass(frozen=True)
class Capabilities:
    """What a drafter can do besides the protocol's calls."""

    batch: bool = False  # drafts for a batch's rows: its `lookup` row by row, its `model_drafter` in batched steps
    replay: bool = False  # the controller can replay it on a served request's tokens (autotune/rewards/replay.py)
    features: bool = False  # drafts from the target's hidden states, handed over by `take_features` (engine/feature.py)
    # drafts with the target's own layers and cache, handed over by `share` (engine/layer_skip.py)
    shares_target: bool = False


NOTHING_MORE = Capabilities()


def capabilities(drafter) -> Capabilities:
    """What `drafter` declares it can do (nothing beyond the protocol if it declares nothing)."""
    return getattr(drafter, "capabilities", NOTHING_MORE)


def model_drafter_of(drafter) -> ModelDrafter | None:
    """The model drafter that runs inside `drafter` (itself, a hybrid's), or None (lookup, OFF)."""
    return getattr(drafter, "model_drafter", None)


def lookup_of(drafter) -> NGramDrafter | None:
    """The prompt lookup `drafter` tries first each round (itself for an n-gram drafter), or None."""
    return getattr(drafter, "lookup", None)


class Drafter(Protocol):
    """`begin` once per request; `propose` / `rollback` once per round."""

    def begin(self, prompt: torch.Tensor, max_length: int) -> None:
        """Start a request; no round will reach beyond `max_length` positions."""
        ...

    def propose(
        self,
        tokens: list[int],
        k: int,
        params: SamplingParams,
        generator: Randomness | None,
    ) -> tuple[list[int], torch.Tensor | None]:
        """Up to k draft tokens following `tokens`, and their q distribution [len, V] or None."""
        ...

    def rollback(self, valid_length: int) -> None:
        """`tokens[:valid_length]` from the last `propose` are now committed; forget the rest."""
        ...


class BatchDrafting(Protocol):
    """A drafter's drafting for the rows of one batch (engine/batch.py `BatchRun`): whatever it
    keeps per row (a cache, a head's state), in the batch's row order. The batch calls these and
    nothing else; a drafter makes one with `for_batch(target, reuse)`, where `reuse` is the
    batch's current one, whose parts that draft with the same model it takes over rather than
    prefill again (`part_for`)."""

    def catch_up(self, rows: list[Row]) -> bool:
        """Hold the batch's live `rows` (the arm switched to this drafter mid-run); True if that ran a forward."""
        ...

    def join(self, rows: list[Row], fed: list[tuple[int, torch.Tensor] | None], replace: bool) -> bool:
        """Rows join after the live ones (`replace`: none is live), with the target's features of
        the positions their prefill fed, (first position, [T, H]), where it kept them; True if
        that ran a forward."""
        ...

    def propose(self, rows: list[Row], ks: list[int]) -> Drafts:
        """Up to ks[b] draft tokens for row b."""
        ...

    def accepted(self, b: int, row: Row, start: int, kept: int, drafts: Drafts, hidden: torch.Tensor | None) -> None:
        """Row b kept `kept` of this round's `drafts` from position `start`; `hidden`: the target's
        features [T, H] of the positions the verify fed for it, when the drafter asks for them."""
        ...

    def select(self, order: list[int]) -> None:
        """Rows left: new row j is old row order[j] (none left: `order` is empty)."""
        ...

    def keep(self, b: int, row: Row, length: int) -> None:
        """A finished row b: keep what it holds of `row.tokens[:length]` for later prompts (engine/prefix.py)."""
        ...

    def compact_if_sparse(self) -> None:
        """Drop the holes rejected drafts left, where they are most of what it holds."""
        ...

    def part_for(self, drafter) -> BatchDrafting | None:
        """The part of this that drafts for `drafter` (itself, a hybrid's inner part), or None."""
        ...


def reusable(reuse: BatchDrafting | None, drafter) -> BatchDrafting | None:
    """What of the batch's current drafting (`reuse`) drafts for `drafter` already."""
    return reuse.part_for(drafter) if reuse is not None else None


class HoldsNothing:
    """The parts of a `BatchDrafting` for a drafter that holds nothing per row: a subclass
    overrides what it holds and drafts (`propose`)."""

    def __init__(self, drafter) -> None:
        self.drafter = drafter

    def catch_up(self, rows: list[Row]) -> bool:
        return False

    def join(self, rows: list[Row], fed: list, replace: bool) -> bool:
        return False

    def accepted(self, b: int, row: Row, start: int, kept: int, drafts: Drafts, hidden: torch.Tensor | None) -> None:
        pass

    def select(self, order: list[int]) -> None:
        pass

    def keep(self, b: int, row: Row, length: int) -> None:
        pass

    def compact_if_sparse(self) -> None:
        pass

    def part_for(self, drafter) -> BatchDrafting | None:
        return self if drafter is self.drafter else None


class RowByRow(HoldsNothing):
    """The batched drafting of a drafter that drafts from the tokens alone, with no state of its
    own (prompt lookup): each row's drafts from `propose`."""

    def propose(self, rows: list[Row], ks: list[int]) -> Drafts:
        return Drafts([self.drafter.propose(r.tokens, k, r.sampling, r.generator)[0] for r, k in zip(rows, ks)],
                      [None] * len(rows))


class HybridBatch(HoldsNothing):
    """A hybrid's batched drafting: lookup row by row, its inner drafter's batched drafting for
    the rows lookup left empty (only they draft there, but every row catches up)."""

    def __init__(self, drafter: HybridDrafter, inner: BatchDrafting) -> None:
        super().__init__(drafter)
        self.inner = inner
        self._round: tuple[Drafts, Drafts] | None = None  # this round's drafts, and the inner drafter's own

    def catch_up(self, rows: list[Row]) -> bool:
        return self.inner.catch_up(rows)

    def join(self, rows: list[Row], fed: list, replace: bool) -> bool:
        return self.inner.join(rows, fed, replace)

    def propose(self, rows: list[Row], ks: list[int]) -> Drafts:
        lookup = self.drafter.lookup
        looked_up = [lookup.propose(r.tokens, k, r.sampling, r.generator)[0] for r, k in zip(rows, ks)]
        inner_ks = [0 if d else k for d, k in zip(looked_up, ks)]
        inner = self.inner.propose(rows, inner_ks) if max(inner_ks, default=0) > 0 else Drafts.none(len(rows))
        drafts = Drafts([d or own for d, own in zip(looked_up, inner.tokens)],
                        [None if d else q for d, q in zip(looked_up, inner.dists)], inner.steps)
        self._round = (drafts, inner)
        return drafts

    def accepted(self, b: int, row: Row, start: int, kept: int, drafts: Drafts, hidden: torch.Tensor | None) -> None:
        ours = self._round is not None and drafts is self._round[0]
        inner = self._round[1] if ours else Drafts.none(len(drafts.tokens))
        self.inner.accepted(b, row, start, kept, inner, hidden)

    def select(self, order: list[int]) -> None:
        self.inner.select(order)

    def keep(self, b: int, row: Row, length: int) -> None:
        self.inner.keep(b, row, length)

    def compact_if_sparse(self) -> None:
        self.inner.compact_if_sparse()

    def part_for(self, drafter) -> BatchDrafting | None:
        return self if drafter is self.drafter else self.inner.part_for(drafter)


class ModelDrafter:
    """A small causal LM sharing the target's vocabulary, with its own persistent KV cache."""

    capabilities = Capabilities(batch=True, replay=True)
    lookup = None

    def __init__(self, model: PreTrainedModel, tokenizer=None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.runner = ModelRunner(model)  # the engine replaces it to match its own cache kind
        self.one_graph = True  # False: draft step by step on a compiled engine too (to measure what it saves)
        self._seen = 0  # positions held in the cache

    @property
    def model_drafter(self) -> ModelDrafter:
        return self

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def max_length(self) -> int | None:
        return getattr(self.model.config, "max_position_embeddings", None)

    def begin(self, prompt: torch.Tensor, max_length: int) -> None:
        self.runner.begin(prompt, max_length)
        self._seen = self._output_start = prompt.numel()

    def propose(self, tokens, k, params, generator):
        device = self.model.device
        pending = tokens[self._seen :]  # 1 token, 2 after a full accept, more after lookup rounds (hybrid)
        if self.runner.kind == "compiled":  # compiled drafter steps exist for 1 and 2 tokens only
            while len(pending) > 2:
                self.runner.step(torch.tensor([pending[:2]], device=device), self._seen, keep=1)
                self._seen += 2
                pending = pending[2:]
        step = torch.tensor([pending], device=device)
        if self.runner.kind == "compiled" and self.one_graph and params.greedy and not params.adjusts_logits:
            draft = self.runner.greedy_drafts(step, self._seen, k).tolist()  # one graph for the round
            self._seen += step.shape[1] + k - 1
            return draft, None
        draft: list[int] = []
        dists = []
        for _ in range(k):
            logits = self.runner.step(step, self._seen, keep=1)[-1]
            self._seen += step.shape[1]
            token, q = draft_token(logits, tokens + draft, self._output_start, params, generator)
            draft.append(token)
            dists += [] if q is None else [q]
            step = torch.tensor([[token]], device=device)
        return draft, (torch.stack(dists) if dists else None)

    def for_batch(self, target: PreTrainedModel, reuse: BatchDrafting | None = None) -> BatchDrafting:
        """Batched steps over a batch cache of this model's (engine/batch.py `ModelBatch`)."""
        from engine.batch import ModelBatch

        return reusable(reuse, self) or ModelBatch(self)

    def replay_chains(self, inputs: ReplayInputs) -> ReplayChains:
        return ReplayChains(model_chains(self.model, inputs))

    def keep(self, tokens: list[int]) -> None:
        """Keep the positions of `tokens` this drafter's cache holds for later prompts (engine/prefix.py)."""
        self.runner.keep(tokens[:self._seen])

    def rollback(self, valid_length: int) -> None:
        if valid_length < self._seen:
            self.runner.truncate(valid_length)
            self._seen = valid_length
        elif self.runner.recurrent:  # every token fed stays: its states need no checkpoint any more
            self.runner.truncate(self._seen)


class NGramDrafter:
    """Prompt lookup: propose what followed the latest earlier match of the last n tokens.

    No model and no distribution (a point mass for rejection sampling). It shines when the
    output copies from the prompt (edits, summaries quoting the source, code refactors).
    """

    capabilities = Capabilities(batch=True, replay=True)
    model_drafter = None

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.vocab_size = None  # any vocabulary: it only copies tokens it has seen
        self.max_length = None

    @property
    def lookup(self) -> NGramDrafter:
        return self

    def begin(self, prompt: torch.Tensor, max_length: int) -> None:
        pass

    def for_batch(self, target: PreTrainedModel, reuse: BatchDrafting | None = None) -> BatchDrafting:
        return RowByRow(self)

    def replay_chains(self, inputs: ReplayInputs) -> ReplayChains:
        chains, proposed = lookup_chains(self, inputs.sequence, inputs.start, inputs.k, inputs.target)
        return ReplayChains(chains, proposed)

    def propose(self, tokens, k, params, generator):
        end = len(tokens)
        for n in range(min(self.max_ngram, end - 1), self.min_ngram - 1, -1):
            tail = tokens[end - n :]
            first = tail[0]
            for start in range(end - n - 1, -1, -1):
                if tokens[start] == first and tokens[start : start + n] == tail:
                    return tokens[start + n : start + n + k], None
        return [], None

    def rollback(self, valid_length: int) -> None:
        pass


class HybridDrafter:
    """Prompt lookup where the context repeats itself, a model (or feature) drafter everywhere else.

    The best single drafter changes within a request: stretches that copy the prompt or loop
    are drafted for free and at length by lookup, fresh text only by a model. Each round takes
    lookup's draft when the last `min_match` tokens occurred earlier in the context (a 1-token
    match is almost always found and seldom right), else the inner drafter's. A model's cache
    skips the lookup rounds and catches up on their tokens at its next draft (one forward; 2
    tokens a step on a compiled runner, whose graphs are 1 and 2 tokens wide), so switching never
    recomputes the prefix; a feature head catches up the same way on the features handed over
    meanwhile. Lossless like any drafter: each round is verified as usual (a lookup draft is a
    point mass under rejection sampling). It can do what its inner drafter can.
    """

    def __init__(self, model: PreTrainedModel | Drafter, max_ngram: int = 3, min_match: int = 2) -> None:
        self.inner = ModelDrafter(model) if isinstance(model, PreTrainedModel) else model
        self.model_drafter = model_drafter_of(self.inner)
        self.capabilities = capabilities(self.inner)
        self.lookup = NGramDrafter(max_ngram, min_match)

    @property
    def vocab_size(self) -> int | None:
        return self.inner.vocab_size

    @property
    def max_length(self) -> int | None:
        return self.inner.max_length

    @property
    def tokenizer(self):
        return getattr(self.inner, "tokenizer", None)

    # A feature drafter's (engine/feature.py), when it is the inner one.
    def attach(self, name: str, target, target_hash: str | None, **options) -> None:
        self.inner.attach(name, target, target_hash, **options)

    def take_features(self, start: int, hidden: torch.Tensor) -> None:
        self.inner.take_features(start, hidden)

    def warm_up(self, ks: list[int]) -> None:
        self.inner.warm_up(ks)

    # A layer-skip drafter's (engine/layer_skip.py), when it is the inner one (`warm_up` above serves it too).
    def share(self, target: ModelRunner) -> None:
        self.inner.share(target)

    @property
    def compile_s(self) -> dict[str, float]:
        return getattr(self.inner, "compile_s", {})

    def begin(self, prompt: torch.Tensor, max_length: int) -> None:
        self.inner.begin(prompt, max_length)

    def for_batch(self, target: PreTrainedModel, reuse: BatchDrafting | None = None) -> BatchDrafting:
        return reusable(reuse, self) or HybridBatch(self, self.inner.for_batch(target, reuse))

    def replay_chains(self, inputs: ReplayInputs) -> ReplayChains | None:
        """Lookup's chains where it proposes, the inner drafter's elsewhere."""
        inner = self.inner.replay_chains(inputs) if capabilities(self.inner).replay else None
        if inner is None:
            return None
        looked_up, proposed = lookup_chains(self.lookup, inputs.sequence, inputs.start, inputs.k, inputs.target)
        return ReplayChains([a if n else b for a, n, b in zip(looked_up, proposed, inner.chains)],
                            [n or inputs.k for n in proposed], [n > 0 for n in proposed])

    def propose(self, tokens, k, params, generator):
        draft, _ = self.lookup.propose(tokens, k, params, generator)
        if draft:
            return draft, None
        return self.inner.propose(tokens, k, params, generator)

    def rollback(self, valid_length: int) -> None:
        self.inner.rollback(valid_length)  # after a lookup round the drafter is behind: nothing to forget
