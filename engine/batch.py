"""Speculative decoding for a batch of requests served together (the load case).

Under load a server decodes many requests in one forward pass. That changes what speculation
costs: a verify feeds B x (K+1) tokens instead of B, and once the batch is large enough for
the forward pass to be compute-bound rather than overhead- or memory-bound, those extra
tokens are no longer free. The best arm at load 1 is then not the best arm under load,
which is what the controller learns per load bucket.

Rows accept different numbers of drafts, so their caches would fall out of step. Instead of
cropping each row, every forward appends the same number of slots for all rows and rejected
slots stay in the cache as holes that a per-row mask hides from every later query (each slot
still sees itself, so no query row is fully masked); once holes are most of the slots, a
round first moves each row's kept slots together and drops the rest (`BatchCache.compact`),
so a batch that never drains does not grow with every round. Positions are per row, so a row decodes
exactly as it would alone: greedy output equals the target's own greedy output, and a
sampled row draws from its own generator in the same order as `SpeculativeEngine.generate`.
Finished rows leave the batch, and new requests can join it between rounds (`BatchRun.admit`:
continuous batching, as vLLM and SGLang schedule every step; with a `prefill_chunk`, a chunk of
a joiner's prefill runs each round while the rows decode: chunked prefill), and so can a
request paused on the one-request path (`SpeculativeEngine.generate`'s `pause`): its target
cache is handed over, and it goes on drawing where it stopped. Eager only
(kvcache.GrowingCache), with drafters that declare `Capabilities(batch=True)` (the engine
refuses others): each drafts through what its `for_batch` gives (engine/drafters.py
`BatchDrafting`; a model's is `ModelBatch` below, a feature head's engine/feature.py's
`HeadBatch`), and the batch never asks a drafter its kind. A round itself is
engine/round.py's, as for one request.
"""

from __future__ import annotations

import weakref
from collections.abc import Generator
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import get_layer_types_and_kwargs

from engine.drafters import BatchDrafting, HoldsNothing, ModelDrafter, capabilities
from engine.errors import InvalidRequestError
from engine.kvcache import GrowingCache, crop_layers, uses_alibi
from engine.prefix import KV, PrefixCache, shared_starts
from engine.round import Drafts, Row, decode_round, stream
from engine.runner import cache_argument
from engine.sampling import adjust_logits, draw, probabilities, token_logprobs


class BatchCache:
    """One model's KV cache for a batch: append-only, with a mask of the slots each row keeps.

    The model gets its masks whole, so what a layer kind sees is applied here, from each slot's
    position in its row: a sliding-window layer the keys less than its window back, a chunked
    layer (Llama 4) the keys in its query's chunk. A model with one kind of layer gets one
    mask; one that mixes kinds gets a mask per kind, keyed as transformers' mask mappings are.
    """

    SEES = {  # layer kind -> which past positions a query at `q` sees, `span` its window or chunk
        "full_attention": None,
        "sliding_attention": lambda q, k, span: q - k < span,
        "chunked_attention": lambda q, k, span: q // span == k // span,
    }

    def __init__(self, model: PreTrainedModel, batch: int) -> None:
        self.model = model
        self.cache_arg = cache_argument(model)
        self.cache = GrowingCache(model.config)
        self.keep = torch.zeros(batch, 0, dtype=torch.bool, device=model.device)  # [B, slots]
        self.position = torch.zeros(batch, 0, dtype=torch.long, device=model.device)  # [B, slots]
        check_batchable(model)
        self.spans = _layer_spans(model)
        self.hidden: torch.Tensor | None = None  # [B, T, H]: the last forward's features, when it was asked for them

    @property
    def slots(self) -> int:
        return self.keep.shape[1]

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, live: torch.Tensor, keep: int = 0,
                features: bool = False):
        """Logits for `ids` [B, T] at `positions`, of the last `keep` of them (0: all); slots where
        `live` is False are holes from the start. `features`: keep the model's last hidden states
        [B, T, H] in `hidden` (a feature head's input)."""
        batch, length = ids.shape
        causal = torch.ones(length, length, dtype=torch.bool, device=ids.device).tril()
        new = (live[:, None, :] & causal) | torch.eye(length, dtype=torch.bool, device=ids.device)
        mask = torch.cat([self.keep[:, None, :].expand(batch, length, self.slots), new], dim=2)[:, None]
        if set(self.spans) != {"full_attention"}:
            query = positions[:, None, :, None]
            key = torch.cat([self.position, positions], dim=1)[:, None, None, :]
            masks = {kind: mask if self.SEES[kind] is None else mask & self.SEES[kind](query, key, span)
                     for kind, span in self.spans.items()}
            mask = masks if len(masks) > 1 else masks.popitem()[1]
        out = self.model(input_ids=ids, position_ids=positions, attention_mask=self._for_attention(mask),
                         **{self.cache_arg: self.cache}, use_cache=True, logits_to_keep=keep,
                         output_hidden_states=features)
        self.hidden = out.hidden_states[-1] if features else None
        self.keep = torch.cat([self.keep, live], dim=1)
        self.position = torch.cat([self.position, positions], dim=1)
        return out.logits

    def _for_attention(self, mask):
        """Eager attention adds its mask: -inf where a boolean mask is False."""
        if isinstance(mask, dict):
            return {kind: self._for_attention(m) for kind, m in mask.items()}
        if self.model.config._attn_implementation != "eager":
            return mask
        return torch.zeros(mask.shape, dtype=self.model.dtype, device=mask.device).masked_fill(
            ~mask, torch.finfo(self.model.dtype).min)

    def forget(self, row: int, start: int) -> None:
        """Row `row` rejected its slots from `start` on: holes from now on."""
        self.keep[row, start:] = False

    def extend(self, other: BatchCache) -> None:
        """Append `other`'s rows (requests joining the batch): each row's slots stay its own, the
        shorter side padded with holes."""
        slots = max(self.slots, other.slots)
        for mine, theirs in zip(self.cache.layers, other.cache.layers, strict=True):
            mine.append_rows(theirs)
        self.keep = torch.cat([torch.nn.functional.pad(keep, (0, slots - keep.shape[1]))
                               for keep in (self.keep, other.keep)])
        self.position = torch.cat([torch.nn.functional.pad(position, (0, slots - position.shape[1]))
                                   for position in (self.position, other.position)])

    @classmethod
    def of(cls, model: PreTrainedModel, cached: list[tuple[torch.Tensor, torch.Tensor]]) -> BatchCache:
        """A one-row batch cache holding `cached` (ModelRunner.cached): a paused request's keys and
        values, so it joins a batch without a second prefill."""
        out = cls(model, 1)
        for layer, (keys, values) in zip(out.cache.layers, cached, strict=True):
            layer.update(keys, values)
        length = cached[0][0].shape[-2]
        out.keep = torch.ones(1, length, dtype=torch.bool, device=model.device)
        out.position = torch.arange(length, device=model.device)[None]
        return out

    def compact_if_sparse(self) -> None:
        """Drop the holes once the slots exceed COMPACT_RATIO times the most any row keeps, plus
        COMPACT_SLACK: every forward appends slots for all rows and holes are never reused, so a
        batch that runs for long (a busy server's never drains) would otherwise attend over, and
        keep in memory, slots for every round it ever ran (1230 slots after 1200 rounds, its
        longest row 51 tokens)."""
        kept = self.keep.sum(1)
        width = int(kept.max())
        if self.slots > COMPACT_RATIO * width + COMPACT_SLACK:
            self.compact(kept, width)

    def compact(self, kept: torch.Tensor, width: int) -> None:
        """Move each row's kept slots (`kept` of them) to its first, in order, and keep `width`
        slots; a row's slots past its own are holes. Keys keep their positions (rotated in
        already) and masks come from each slot's position, so attention sees what it saw."""
        index = torch.sort((~self.keep).to(torch.uint8), dim=1, stable=True).indices[:, :width]
        for layer in self.cache.layers:
            layer.keep_slots(index)
        self.keep = torch.arange(width, device=self.keep.device)[None] < kept[:, None]
        self.position = self.position.gather(1, index)

    def row(self, b: int, length: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Row b's keys and values of the first `length` slots it keeps (all: None), in order [1,
        heads, length, width] (a copy): its positions 0.. (kept slots are in position order), to
        keep for later prompts (engine/prefix.py)."""
        slots = self.keep[b].nonzero()[:length, 0]
        return [(layer.keys[b:b + 1, :, slots], layer.values[b:b + 1, :, slots]) for layer in self.cache.layers]

    def select(self, rows: list[int]) -> None:
        """Keep only these rows (finished requests leave the batch); a row may be repeated."""
        index = torch.tensor(rows, device=self.keep.device)
        self.cache.batch_select_indices(index)
        self.keep = self.keep[index]
        self.position = self.position[index]


_SPANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def check_batchable(model: PreTrainedModel) -> None:
    """Refuse, naming them, a model with layers a batch cannot mask (linear attention...) or
    position biases it cannot keep (ALiBi)."""
    if unknown := set(_layer_spans(model)) - set(BatchCache.SEES):
        raise InvalidRequestError(f"{type(model).__name__} has {', '.join(sorted(unknown))} layers, which cannot"
                                  " run batched (batches take full, sliding-window and chunked attention)")
    if uses_alibi(model.config):
        raise InvalidRequestError(f"{type(model).__name__} biases attention by ALiBi, which transformers works out"
                                  " from cache slots or a 2-D mask, not positions: a batch's holes would shift it"
                                  " (MPT decoded other tokens), so it runs one request at a time")


def _layer_spans(model: PreTrainedModel) -> dict[str, int | None]:
    """{layer kind: its window or chunk} of a model, worked out once (a batch makes a cache for
    every join)."""
    if model not in _SPANS:
        kinds, per_layer = get_layer_types_and_kwargs(model.config.get_text_config(decoder=True))
        _SPANS[model] = {kind: kwargs.get("sliding_window") for kind, kwargs in zip(kinds, per_layer)}
    return _SPANS[model]


# A batch cache drops its holes once its slots exceed COMPACT_RATIO x its longest row + COMPACT_SLACK
# (compacting more often copies more, less often attends over more holes).
COMPACT_RATIO = 1.25
COMPACT_SLACK = 64
PROMPT_LOGITS_BUDGET = 1 << 26  # logits (rows x positions x vocabulary) a prefill that scores prompts holds at once
# What one more prefill forward costs beyond its tokens, in tokens of prefill (a forward's fixed
# cost); a prefill pays for padding rows to its longest one, so rows of very different lengths
# are fed in separate forwards when that saves more padding than this.
FORWARD_COST_TOKENS = 256


@dataclass
class Prefilled:
    """What a batch prefill leaves (see `prefilled`), a row each but `cache`."""

    cache: BatchCache
    last_logits: list[torch.Tensor | None]  # [1, V]; None for a row resumed from its cache
    prompt_logprobs: list[list[dict[int, float] | None] | None]  # scored rows' entries, else None
    reused: list[int]  # positions taken from kept prefixes
    features: list[torch.Tensor | None]  # [T, H] of the positions fed (from `reused` on), when asked for


def prefilled(model: PreTrainedModel, seqs: list[list[int]], scores: list[int | None] | None = None,
              cached: list | None = None, share: bool = True, prefixes: PrefixCache | None = None,
              features: bool = False) -> Prefilled:
    """A batch cache of `seqs` from position 0, each row's last logits [1, V] (None for a
    `cached` row), the prompt log-probabilities of the rows with a `scores` entry (vLLM's
    prompt_logprobs, that many likeliest per token; else None), how many of each row's
    positions came from `prefixes` (earlier prompts' keys and values; rows are kept there too)
    and, with `features`, the model's last hidden states of the positions each row fed (a feature
    head's input; None for a `cached` row).

    Rows with the same tokens and scoring (a request's n choices) are fed once and their cache
    rows copied: prefill costs about its tokens on a busy device; `share=False` feeds every row
    (the baseline of `autotune bench choices`). Rows are fed in groups of similar length
    (`length_groups`), so short prompts are not padded to a long one's length. A row with a
    `cached` entry (a paused request's keys and values, ModelRunner.cached) is not fed at all, and
    one that starts as a kept prompt did is fed from where they part (rows not scored); rows that
    start alike beyond what is kept have the start they share fed once (from what is kept of it),
    when that saves more than a forward costs (FORWARD_COST_TOKENS)."""
    return finish(prefill_steps(model, seqs, scores, cached, share, prefixes=prefixes, features=features))


def finish(steps: Generator[int, None, tuple]) -> tuple:
    """Run `prefill_steps` to its end; what it returns."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def prefill_steps(model: PreTrainedModel, seqs: list[list[int]], scores: list[int | None] | None = None,
                  cached: list | None = None, share: bool = True, chunk_tokens: int | None = None,
                  prefixes: PrefixCache | None = None, features: bool = False
                  ) -> Generator[int, None, Prefilled]:
    """`prefilled` a forward at a time: the generator stops before each forward, yielding the
    tokens it will feed (rows x columns, padding included), and returns what `prefilled` does.
    With `chunk_tokens`, no forward feeds more than that many (one column at least): a batch
    runs such forwards up to that many tokens a round while its rows go on decoding (chunked
    prefill, as vLLM's), so a long prompt joining stalls them for a chunk, not for its whole
    prefill."""
    scores = scores if scores is not None else [None] * len(seqs)
    cached = cached if cached is not None else [None] * len(seqs)
    fed: list[list[int]] = []
    fed_scores: list[int | None] = []
    fed_cached: list = []
    where: dict[tuple, int] = {}  # (sequence, scoring) -> its row among those fed
    source = []  # each row's row among those fed
    for b, (seq, top, kv) in enumerate(zip(seqs, scores, cached)):
        key = (tuple(seq), top) if share and kv is None else (b,)
        if key not in where:
            where[key] = len(fed)
            fed.append(seq)
            fed_scores.append(top)
            fed_cached.append(kv)
        source.append(where[key])
    fresh = [i for i, kv in enumerate(fed_cached) if kv is None]
    kept = {}  # fed row -> (positions, keys and values) it takes from `prefixes`
    if prefixes is not None:
        kept = yield from _reusable(model, fed, [i for i in fresh if fed_scores[i] is None], prefixes, chunk_tokens)
    groups = [[i] for i, kv in enumerate(fed_cached) if kv is not None]
    for rows in ([i for i in fresh if i not in kept], [i for i in fresh if i in kept]):  # fed from 0; from a prefix
        if rows:
            lengths = [len(fed[i]) - kept.get(i, (0,))[0] for i in rows]
            groups += [[rows[k] for k in group] for group in length_groups(lengths)]
    cache, lasts, entries, order = None, [None] * len(fed), [None] * len(fed), []
    hidden: list[torch.Tensor | None] = [None] * len(fed)
    for group in groups:
        if fed_cached[group[0]] is not None:  # a resumed row: its next token was drawn before the pause
            part, scored = BatchCache.of(model, fed_cached[group[0]]), [None]
        else:
            start = _cache_of(model, [kept[i][1] for i in group]) if group[0] in kept else None
            offsets = [kept.get(i, (0,))[0] for i in group]
            part, last, scored, states = yield from _prefill_group(
                model, [fed[i][n:] for i, n in zip(group, offsets)], [fed_scores[i] for i in group], chunk_tokens,
                start, offsets, features)
            for k, i in enumerate(group):
                lasts[i] = last[k:k + 1]
                if states is not None:  # right-aligned: the row's fed positions are its last columns
                    hidden[i] = states[k, states.shape[1] - (len(fed[i]) - offsets[k]):]
                if prefixes is not None:
                    prefixes.insert(fed[i], lambda k=k, part=part: part.row(k))
        if cache is None:
            cache = part
        else:
            cache.extend(part)  # each row keeps its own slots; the shorter group's are padded with holes
        order += group
        for i, row_entries in zip(group, scored):
            entries[i] = row_entries
    row_of = {f: r for r, f in enumerate(order)}  # a fed sequence -> its row in the cache
    rows = [row_of[f] for f in source]
    if rows != list(range(len(order))):
        cache.select(rows)
    return Prefilled(cache, [lasts[f] for f in source], [entries[f] for f in source],
                     [kept.get(f, (0,))[0] for f in source], [hidden[f] for f in source])


def _reusable(model: PreTrainedModel, seqs: list[list[int]], rows: list[int], prefixes: PrefixCache,
              chunk_tokens: int | None) -> Generator[int, None, dict[int, tuple[int, KV]]]:
    """For `rows` of `seqs` (prompts not scored), the positions each takes from `prefixes` and
    their keys and values: the most a kept prompt holds, or more where rows start alike beyond
    that and feeding the start they share once (from what is kept of it, in a forward of its own)
    saves more than a forward costs. Stops before each forward, as `prefill_steps` does."""
    kept = {}
    for i in rows:
        n, kv = prefixes.lookup(seqs[i])
        if n:
            kept[i] = (n, kv)
    for start, sharing in shared_starts(seqs, rows):
        n, kv = prefixes.lookup(start)
        saved = sum(len(start) - kept.get(i, (0,))[0] for i in sharing) - (len(start) - n)
        if saved > FORWARD_COST_TOKENS:
            part, _, _, _ = yield from _prefill_group(model, [start[n:]], [None], chunk_tokens,
                                                      _cache_of(model, [kv]) if n else None, [n])
            kv = part.row(0)
            prefixes.insert(start, lambda kv=kv: kv)
            kept.update((i, (len(start), kv)) for i in sharing if kept.get(i, (0,))[0] < len(start))
    return kept


def _cache_of(model: PreTrainedModel, kvs: list[KV]) -> BatchCache:
    """A batch cache holding these keys and values, a row each (shorter rows padded with holes)."""
    cache = BatchCache.of(model, kvs[0])
    for kv in kvs[1:]:
        cache.extend(BatchCache.of(model, kv))
    return cache


def length_groups(lengths: list[int]) -> list[list[int]]:
    """The indexes of `lengths` in groups to prefill one forward each, the cheapest split into
    runs of sorted lengths when a forward costs FORWARD_COST_TOKENS plus rows x its longest row."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    best = [0] + [None] * len(order)  # best[j]: the cost of the first j sorted rows
    cut = [0] * (len(order) + 1)
    for j in range(1, len(order) + 1):
        for i in range(j):
            cost = best[i] + FORWARD_COST_TOKENS + (j - i) * lengths[order[j - 1]]
            if best[j] is None or cost < best[j]:
                best[j], cut[j] = cost, i
    groups, j = [], len(order)
    while j:
        groups.append(order[cut[j]:j])
        j = cut[j]
    return groups[::-1]


def _prefill_group(model: PreTrainedModel, seqs: list[list[int]], scores: list[int | None],
                   chunk_tokens: int | None = None, start: BatchCache | None = None, offsets: list[int] | None = None,
                   features: bool = False
                   ) -> Generator[int, None, tuple[BatchCache, torch.Tensor, list, torch.Tensor | None]]:
    """The prefill of `seqs` (right-aligned), stopping before each forward: one forward, or
    chunks of columns of at most `chunk_tokens` tokens; after the rows of `start`, a cache of
    their first `offsets` positions (kept prefixes), if given. With `features`, the model's last
    hidden states [B, T, H] of every column fed, else None. Where prompts are scored the rows are
    fed in chunks too, each chunk's logits reduced to entries before the next, so a batch of
    long prompts (an evaluation harness's log-likelihoods) holds at most PROMPT_LOGITS_BUDGET
    logits, not rows x prompt x vocabulary (16 x 1000 x 32k: 2 GB in float32)."""
    cache = start if start is not None else BatchCache(model, len(seqs))
    ids, live = _block(seqs, model.device, right=True)
    positions = _positions(live, offsets or [0] * len(seqs))
    width = ids.shape[1]
    entries: list = [None if top is None else [None] for top in scores]
    scoring = any(top is not None for top in scores)
    chunk = width
    if scoring:
        vocab = model.config.get_text_config(decoder=True).vocab_size
        chunk = max(1, PROMPT_LOGITS_BUDGET // (len(seqs) * vocab))
    if chunk_tokens is not None:
        chunk = min(chunk, max(1, chunk_tokens // len(seqs)))
    states = []
    for start in range(0, width, chunk):
        end = min(start + chunk, width)
        yield len(seqs) * (end - start)
        logits = cache.forward(ids[:, start:end], positions[:, start:end], live[:, start:end],
                               keep=0 if scoring else 1, features=features)
        if features:
            states.append(cache.hidden)
        for b, top in enumerate(scores):
            first = width - len(seqs[b])  # the row's first column; a column's logits score the next token
            lo, hi = max(start, first), min(end, width - 1)
            if top is not None and lo < hi:
                logp = torch.log_softmax(logits[b, lo - start:hi - start].float(), dim=-1)
                entries[b] += token_logprobs(logp, seqs[b][lo + 1 - first:hi + 1 - first], top)
    return cache, logits[:, -1], entries, torch.cat(states, dim=1) if features else None


def _block(seqs: list[list[int]], device, right: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """ids and live mask [B, T] for sequences of different lengths, padded with holes.

    Right-aligned, the last column holds every row's newest token (prefill, drafter steps);
    left-aligned, column j is every row's j-th token (a verify of drafts of different lengths).
    """
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    live = torch.zeros(len(seqs), width, dtype=torch.bool)
    for b, s in enumerate(seqs):
        if s:
            cols = slice(width - len(s), width) if right else slice(0, len(s))
            ids[b, cols] = torch.tensor(s)
            live[b, cols] = True
    return ids.to(device), live.to(device)


def _positions(live: torch.Tensor, start: list[int]) -> torch.Tensor:
    """Each live token's position in its row (holes reuse a neighbour's; they are never seen)."""
    before = (live.long().cumsum(1) - 1).clamp(min=0)
    return before + torch.tensor(start, device=live.device)[:, None]


class ModelBatch(HoldsNothing):
    """A model drafter's drafting for the rows of a batch: K one-token steps of its model over a
    batch cache of its own (the first step may catch a row up on tokens lookup drafted)."""

    def __init__(self, drafter: ModelDrafter) -> None:
        super().__init__(drafter)
        self.prefixes = drafter.runner.prefixes  # the drafter's kept prompts
        self.cache: BatchCache | None = None  # None: it holds no row yet
        self.first_slot = 0  # this round's: where its first draft token goes

    def _prefilled(self, rows: list[Row]) -> BatchCache:
        cache = prefilled(self.drafter.model, [r.tokens[:-1] for r in rows], prefixes=self.prefixes).cache
        for r in rows:
            r.seen = len(r.tokens) - 1
        return cache

    def catch_up(self, rows: list[Row]) -> bool:
        if self.cache is not None:
            return False
        self.cache = self._prefilled(rows)
        return True

    def join(self, rows: list[Row], fed: list, replace: bool) -> bool:
        cache = self._prefilled(rows)
        if replace or self.cache is None:
            self.cache = cache
        else:
            self.cache.extend(cache)
        return True

    def propose(self, rows: list[Row], ks: list[int]) -> Drafts:
        if max(ks, default=0) == 0:
            return Drafts.none(len(rows))
        device = self.cache.model.device
        ids, live = _block([r.tokens[r.seen:] for r in rows], device, right=True)
        positions = _positions(live, [r.seen for r in rows])
        self.first_slot = self.cache.slots + ids.shape[1] - 1
        drafts: list[list[int]] = [[] for _ in rows]
        dists: list[list[torch.Tensor]] = [[] for _ in rows]
        for i in range(max(ks)):
            logits = self.cache.forward(ids, positions, live, keep=1)[:, -1]
            for b, r in enumerate(rows):
                if i < ks[b] and r.sampling.adjusts_logits:  # drafted as the target will pick (see ModelDrafter)
                    logits[b] = adjust_logits(logits[b:b + 1], r.tokens + drafts[b], [], r.stopping.output_start,
                                         r.sampling)[0]
            chosen = logits.argmax(-1).tolist()
            for b, r in enumerate(rows):
                if i < ks[b] and not r.sampling.greedy:
                    q = probabilities(logits[b], r.sampling)
                    chosen[b] = draw(q, r.generator, len(r.tokens) + len(drafts[b]))
                    dists[b].append(q)
                if i < ks[b]:
                    drafts[b].append(chosen[b])
            ids = torch.tensor([[t] for t in chosen], device=device)
            positions = positions[:, -1:] + 1
            live = torch.ones_like(ids, dtype=torch.bool)
        for r in rows:
            r.seen = len(r.tokens)
        return Drafts(drafts, [torch.stack(d) if d else None for d in dists], steps=max(ks))

    def accepted(self, b: int, row: Row, start: int, kept: int, drafts: Drafts, hidden: torch.Tensor | None) -> None:
        """The model fed the first `steps - 1` of its drafts; a row lookup drafted kept none of them."""
        if not drafts.steps:
            return
        fed = min(kept if drafts.tokens[b] else 0, drafts.steps - 1)
        self.cache.forget(b, self.first_slot + 1 + fed)
        row.seen += fed

    def select(self, order: list[int]) -> None:
        if order and self.cache is not None:
            self.cache.select(order)

    def keep(self, b: int, row: Row, length: int) -> None:
        if self.prefixes is not None and self.cache is not None:
            seen = min(row.seen, length)
            self.prefixes.insert(row.tokens[:seen], lambda: self.cache.row(b, seen))

    def compact_if_sparse(self) -> None:
        if self.cache is not None:
            self.cache.compact_if_sparse()


@dataclass
class _Join:
    """Requests admitted while rows decode, their target prefill run within each round's budget."""

    indexes: list[int]  # into the run's rows
    steps: Generator[int, None, Prefilled]  # prefill_steps, stopped before its next forward
    size: int  # the tokens of that forward
    forwards: int = 0  # run so far
    target_s: float = 0.0  # seconds its forwards took


class BatchRun:
    """A batch decoding that requests join between rounds (continuous batching), on an arm that
    may change between rounds.

    A row that joins is prefilled on its own (target, and the drafter's cache if the arm has a
    model drafter; a feature head's drafter takes the features of the target's prefill), and its
    caches are appended to the batch's as more rows, their slots padded with holes: masks and
    per-row positions already keep rows apart, so a row decodes exactly as it would alone
    whenever it joined. A switch to another model drafter prefills that drafter over every live
    row's context, a switch to a feature head runs the target over it once more for its
    features; K and n-gram lookup need nothing.

    With `prefill_chunk` (tokens), requests admitted while rows decode wait in `joins` and their
    target prefill runs at most that many tokens per round (vLLM's token budget of a step), in
    forwards before the round's draft and verify (chunked prefill); they join when it is done,
    so a join that fits the budget joins as it would at once. A join that fails there is
    retried a request at a time, and a request that fails alone is reported in `failed` while
    the batch goes on.
    """

    def __init__(self, target: PreTrainedModel, drafter, k: int, batch, clock,
                 prefill_chunk: int | None = None, prefixes: PrefixCache | None = None) -> None:
        if prefill_chunk is not None and prefill_chunk < 1:
            raise InvalidRequestError(f"prefill_chunk must be a positive number of tokens, not {prefill_chunk}")
        self.target, self.batch, self.clock = target, batch, clock
        self.prefill_chunk = prefill_chunk
        self.prefixes = prefixes  # the target's kept prompts (engine/prefix.py)
        self.rows: dict[int, Row] = {}  # by index, in the order added (BatchSession may forget finished ones)
        self.added = 0  # rows added so far: the next one's index
        self.live: list[int] = []  # indexes into rows, in the caches' row order
        self.joins: list[_Join] = []  # admitted, prefilling a chunk per round (oldest first)
        self.finished: list[int] = []  # rows done since the caller last took them
        self.failed: list[tuple[int, Exception]] = []  # rows whose prefill failed, since the caller last took them
        self.target_cache: BatchCache | None = None
        self.drafts: BatchDrafting | None = None  # the drafter's state for the live rows (`Drafter.for_batch`)
        self.fell_back, self.error = False, None
        # Tokens the rounds committed, and live rows summed over rounds (OFF commits one per row
        # per round, so committed / row_rounds is a round's gain over OFF; row_rounds / rounds, the mean load).
        self.committed = 0
        self.row_rounds = 0
        self.first_slot = 0  # this round's: where the verify's slots begin in the target's cache
        self.started = clock()
        self.drafter, self.k = drafter, k
        self.drafts = drafter.for_batch(target) if drafter is not None else None

    @property
    def _features(self) -> bool:
        """The drafter drafts from the target's features: prefills and verifies keep them."""
        return self.drafts is not None and capabilities(self.drafter).features

    def switch(self, drafter, k: int) -> None:
        """Decode on (drafter, k) from the next round on. A drafter new to the batch takes in the
        live rows now (its prefill); what the current one holds for the same model is kept."""
        if self.fell_back:
            return
        drafts = drafter.for_batch(self.target, self.drafts) if drafter is not None else None
        if drafts is not None and self.live:
            began = self.clock()
            try:
                prefilled_rows = drafts.catch_up([self.rows[i] for i in self.live])
            except Exception as exc:  # speculation must never lose a request
                self.fall_back(f"{type(exc).__name__}: {exc}")
                return
            if prefilled_rows:
                spent = self.clock() - began
                self.batch.prefill_s += spent  # a prefill, the drafter's only, as a join's counts it
                self.batch.draft_prefill_s += spent
        self.drafter, self.k, self.drafts = drafter, k, drafts

    def elapsed(self) -> float:
        """Engine seconds since the run began (the streamers' time left out)."""
        return self.clock() - self.started - self.batch.stream_s

    def admit(self, rows: list[Row]) -> None:
        """Add `rows` to the batch: prefilled now, or, with `prefill_chunk` while rows decode,
        within each round's budget from the next round on (a waiting join nothing has been fed
        for yet takes them in). Their indexes are the next ones either way."""
        if not rows:
            return
        joined_at = self.elapsed()
        for r in rows:
            r.joined_s = joined_at
        if self.prefill_chunk is None or not self.live or all(r.resumes is not None for r in rows):
            began = self.clock()
            done = finish(self._prefill(rows, None))
            spent = self.clock() - began
            self.batch.prefill_s += spent
            self._join(self._register(rows), done, spent)
            return
        waiting = self.joins[-1] if self.joins and not self.joins[-1].forwards else None
        steps = self._prefill([*(self.rows[i] for i in waiting.indexes), *rows] if waiting else rows,
                              self.prefill_chunk)
        size = next(steps)  # set up, to just before its first forward (a fresh row has one)
        indexes = (waiting.indexes if waiting else []) + self._register(rows)
        if waiting:
            waiting.indexes, waiting.steps, waiting.size = indexes, steps, size
        else:
            self.joins.append(_Join(indexes, steps, size))

    def _register(self, rows: list[Row]) -> list[int]:
        """Give `rows` the next indexes; those indexes."""
        indexes = list(range(self.added, self.added + len(rows)))
        self.rows.update(zip(indexes, rows))
        self.added += len(rows)
        return indexes

    def _prefill(self, rows: list[Row], chunk_tokens: int | None) -> Generator[int, None, Prefilled]:
        """The target's prefill of rows joining, keeping its features while the arm drafts with a
        feature head. A paused request's last token is the one its next round feeds (the cache
        holds all but the last token), so it resumes drawing exactly where it stopped."""
        asked = [r.sampling.prompt_logprobs if r.resumes is None else None for r in rows]
        return prefill_steps(self.target, [r.tokens[:-1] if r.resumes else r.tokens for r in rows], asked,
                             [r.cached if r.resumes else None for r in rows], chunk_tokens=chunk_tokens,
                             prefixes=self.prefixes, features=self._features)

    def _advance_joins(self) -> None:
        """Prefill forwards of the waiting joins, oldest first, while this round's stay within
        `prefill_chunk` tokens (one forward at least); while no row decodes, every waiting join
        to its end (nothing stalls on them)."""
        fed = 0
        while self.joins:
            join = self.joins[0]
            if self.live and fed and fed + join.size > self.prefill_chunk:
                return
            fed += join.size
            began = self.clock()
            done = None
            try:
                join.size = next(join.steps)
            except StopIteration as stop:
                done = stop.value
            except Exception as exc:  # memory, a model error: retried a request at a time
                self.batch.prefill_s += self.clock() - began
                self.joins.pop(0)
                self._join_failed(join, exc)
                continue
            spent = self.clock() - began
            join.forwards += 1
            join.target_s += spent
            self.batch.prefill_s += spent
            if done is not None:
                self.joins.pop(0)
                self._join(join.indexes, done, join.target_s)

    def _join_failed(self, join: _Join, exc: Exception) -> None:
        """A waiting join's prefill raised: each of several requests is tried again alone (at the
        front of the queue); one alone fails, and the batch goes on without it."""
        if len(join.indexes) == 1:
            i = join.indexes[0]
            self.rows[i].done = True
            self.failed.append((i, exc))
            return
        alone = []
        for i in join.indexes:
            steps = self._prefill([self.rows[i]], self.prefill_chunk)
            alone.append(_Join([i], steps, next(steps)))
        self.joins[:0] = alone

    def _join(self, indexes: list[int], prefill: Prefilled, target_s: float) -> None:
        """Rows whose target prefill is done join the batch: each draws its first token, the
        drafter's cache is prefilled for them, and both caches take them as more rows."""
        rows = [self.rows[i] for i in indexes]
        cache, reused = prefill.cache, prefill.reused
        for b, r in enumerate(rows):
            r.logprobs = None if r.sampling.logprobs is None else []
            r.cached = None  # in the batch's cache now
            if r.resumes is None:
                if r.sampling.prompt_logprobs is not None:
                    r.prompt_logprobs = prefill.prompt_logprobs[b]
                r.start(prefill.last_logits[b])
        draft_prefill = 0.0
        if self.drafts is not None:
            began = self.clock()
            fed = [(n, states) if states is not None else None for n, states in zip(reused, prefill.features)]
            try:
                ran = self.drafts.join(rows, fed, replace=not self.live)
            except Exception as exc:  # speculation must never lose a request
                self.fall_back(f"{type(exc).__name__}: {exc}")
                ran = True
            draft_prefill = self.clock() - began if ran else 0.0
        self.batch.prefill_s += draft_prefill
        self.batch.draft_prefill_s += draft_prefill
        for r, n in zip(rows, reused):
            if r.resumes is not None:
                r.stopped = r.stopping.end(r.tokens, len(r.tokens) - 1) is not None
                r.done = r.stopped or r.remaining <= 0
            r.metrics.prefill_s, r.metrics.draft_prefill_s = target_s + draft_prefill, draft_prefill
            r.metrics.cached_prompt_tokens = n
        if self.live:
            self.target_cache.extend(cache)
        else:  # the first rows, or every row before them has finished
            self.target_cache = cache
        self.live += indexes
        stream(rows, [r.prompt_len for r in rows], self.batch, prompt=True)
        self._drop_finished()

    def step(self, off: bool = False) -> None:
        """One round for every live row: draft, verify, commit (after a chunk of a waiting join's
        prefill); `off`: no drafts, the round timed as a probe of OFF's step where the arm drafts."""
        self._advance_joins()
        if not self.live:
            return
        self.target_cache.compact_if_sparse()
        if self.drafts is not None:
            self.drafts.compact_if_sparse()
        active = [self.rows[i] for i in self.live]
        starts = [len(r.tokens) for r in active]
        began = self.clock()
        report = decode_round(self, active, 0 if off else self.k, self.clock, self.batch, began)
        if off and self.drafting:
            for metrics, tokens in [(self.batch, len(active)), *((r.metrics, 1) for r in active)]:
                metrics.probe_s += report.ended - began
                metrics.probe_rounds += 1
                metrics.probe_tokens += tokens
        self.committed += sum(report.committed)
        self.row_rounds += len(active)
        stream(active, starts, self.batch)
        self._drop_finished()

    # How a batch's round feeds the models (engine.round.Feed).

    @property
    def drafting(self) -> bool:
        return self.drafter is not None

    def draft(self, rows: list[Row], ks: list[int]) -> Drafts:
        return self.drafts.propose(rows, ks)

    def verify(self, rows: list[Row], drafts: list[list[int]]) -> torch.Tensor:
        """The target's forward over each row's last token and its drafts, left-aligned."""
        ids, live = _block([[r.tokens[-1], *d] for r, d in zip(rows, drafts)], self.target.device, right=False)
        positions = _positions(torch.ones_like(live), [len(r.tokens) - 1 for r in rows])
        self.first_slot = self.target_cache.slots
        return self.target_cache.forward(ids, positions, live, features=self._features)

    def undo_verify(self, rows: list[Row]) -> None:
        crop_layers(self.target_cache.cache, self.first_slot)

    def accepted(self, b: int, row: Row, start: int, kept: int, drafts: Drafts) -> None:
        self.target_cache.forget(b, self.first_slot + 1 + kept)
        if self.drafts is None:
            return
        hidden = self.target_cache.hidden[b] if self._features else None
        try:
            self.drafts.accepted(b, row, start, kept, drafts, hidden)
        except Exception as exc:  # speculation must never lose a request
            self.fall_back(f"drafter: {type(exc).__name__}: {exc}")

    def fall_back(self, error: str) -> None:
        """The drafter failed: the rest of the run is OFF, and every request is still served."""
        self.drafter, self.drafts, self.fell_back, self.error = None, None, True, error

    def _drop_finished(self) -> None:
        """Finished rows leave the batch (and wait in `finished` for the caller)."""
        elapsed = self.elapsed()
        keep = [b for b, i in enumerate(self.live) if not self.rows[i].done]
        if len(keep) == len(self.live):
            return
        finished = [i for i in self.live if self.rows[i].done]
        for b, i in enumerate(self.live):
            if self.rows[i].done:
                self._keep(b, self.rows[i])
        # Each hole among the first len(keep) cache rows takes a kept row from behind them, so the
        # caches copy one row per request that left, not every row behind it (row order is free).
        behind = [b for b in keep if b >= len(keep)]
        kept = set(keep)
        order = [b if b in kept else behind.pop() for b in range(len(keep))]
        self.live[:] = [self.live[b] for b in order]
        if order:
            self.target_cache.select(order)
        if self.drafts is not None:
            self.drafts.select(order)
        for i in finished:
            self.rows[i].metrics.total_s = elapsed - self.rows[i].joined_s
        self.finished += finished


    def _keep(self, b: int, row: Row) -> None:
        """Keep a finished row's prompt and output, cache row b, for later prompts that start with
        them (a chat's next turn), in the target's and the drafter's kept prompts."""
        n = len(row.tokens) - 1  # the last token was never fed (a stop string may have cut fed ones)
        if self.prefixes is not None:
            self.prefixes.insert(row.tokens[:n], lambda: self.target_cache.row(b, n))
        if self.drafts is not None:
            self.drafts.keep(b, row, n)
