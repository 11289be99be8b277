"""Speculative decoding for a batch of requests served together (the load case).

Under load a server decodes many requests in one forward pass. That changes what speculation
costs: a verify feeds B x (K+1) tokens instead of B, and once the batch is large enough for
the forward pass to be compute-bound rather than overhead- or memory-bound, those extra
tokens are no longer free. The best arm at load 1 is then not the best arm under load,
which is what the controller learns per load bucket.

Rows accept different numbers of drafts, so their caches would fall out of step. Instead of
cropping each row, every forward appends the same number of slots for all rows and rejected
slots stay in the cache as holes that a per-row mask hides from every later query (each slot
still sees itself, so no query row is fully masked). Positions are per row, so a row decodes
exactly as it would alone: greedy output equals the target's own greedy output, and a
sampled row draws from its own generator in the same order as `SpeculativeEngine.generate`.
Finished rows leave the batch. Eager only (kvcache.GrowingCache); model, n-gram and hybrid drafters (the
engine refuses others): in a hybrid round, rows whose context repeats take lookup drafts and the
others share the model's batched steps.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from engine.drafters import HybridDrafter, ModelDrafter, model_drafter_of
from engine.kvcache import GrowingCache
from engine.sampling import SamplingParams, probabilities, sample, verify_greedy, verify_sampled
from engine.streaming import Streamer, put_prompt, put_tokens


class BatchCache:
    """One model's KV cache for a batch: append-only, with a mask of the slots each row keeps."""

    def __init__(self, model: PreTrainedModel, batch: int) -> None:
        self.model = model
        self.cache = GrowingCache(model.config)
        self.keep = torch.zeros(batch, 0, dtype=torch.bool, device=model.device)  # [B, slots]

    @property
    def slots(self) -> int:
        return self.keep.shape[1]

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, live: torch.Tensor, last_only: bool = False):
        """Logits for `ids` [B, T] at `positions`; slots where `live` is False are holes from the start."""
        batch, length = ids.shape
        causal = torch.ones(length, length, dtype=torch.bool, device=ids.device).tril()
        new = (live[:, None, :] & causal) | torch.eye(length, dtype=torch.bool, device=ids.device)
        mask = torch.cat([self.keep[:, None, :].expand(batch, length, self.slots), new], dim=2)[:, None]
        if self.model.config._attn_implementation == "eager":  # eager attention adds its mask
            mask = torch.zeros(mask.shape, dtype=self.model.dtype, device=ids.device).masked_fill(
                ~mask, torch.finfo(self.model.dtype).min)
        out = self.model(input_ids=ids, position_ids=positions, attention_mask=mask, past_key_values=self.cache,
                         use_cache=True, logits_to_keep=1 if last_only else 0)
        self.keep = torch.cat([self.keep, live], dim=1)
        return out.logits

    def forget(self, row: int, start: int) -> None:
        """Row `row` rejected its slots from `start` on: holes from now on."""
        self.keep[row, start:] = False

    def select(self, rows: list[int]) -> None:
        """Keep only these rows (finished requests leave the batch)."""
        index = torch.tensor(rows, device=self.keep.device)
        self.cache.batch_select_indices(index)
        self.keep = self.keep[index]


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


@dataclass
class Row:
    """One request's state in the batch."""

    tokens: list[int]  # prompt + committed output
    prompt_len: int
    max_new_tokens: int
    sampling: SamplingParams
    generator: torch.Generator | None
    streamer: Streamer | None = None
    stream_error: str | None = None  # its streamer raised: the row leaves the batch
    seen: int = 0  # tokens the drafter's cache holds for this row
    done: bool = False

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - (len(self.tokens) - self.prompt_len)


class BatchDrafter:
    """A model drafter run for the whole batch: K one-token steps (the first may catch up 2)."""

    def __init__(self, drafter: ModelDrafter, rows: list[Row]) -> None:
        self.cache = BatchCache(drafter.model, len(rows))
        ids, live = _block([r.tokens[:-1] for r in rows], drafter.model.device, right=True)
        self.cache.forward(ids, _positions(live, [0] * len(rows)), live, last_only=True)
        for r in rows:
            r.seen = len(r.tokens) - 1

    def propose(self, rows: list[Row], ks: list[int]) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        device = self.cache.model.device
        ids, live = _block([r.tokens[r.seen:] for r in rows], device, right=True)
        positions = _positions(live, [r.seen for r in rows])
        self.first_slot = self.cache.slots + ids.shape[1] - 1  # where the first draft token goes
        drafts: list[list[int]] = [[] for _ in rows]
        dists: list[list[torch.Tensor]] = [[] for _ in rows]
        for i in range(max(ks)):
            logits = self.cache.forward(ids, positions, live, last_only=True)[:, -1]
            chosen = logits.argmax(-1).tolist()
            for b, r in enumerate(rows):
                if i < ks[b] and not r.sampling.greedy:
                    q = probabilities(logits[b], r.sampling)
                    chosen[b] = sample(q, r.generator)
                    dists[b].append(q)
                if i < ks[b]:
                    drafts[b].append(chosen[b])
            ids = torch.tensor([[t] for t in chosen], device=device)
            positions = positions[:, -1:] + 1
            live = torch.ones_like(ids, dtype=torch.bool)
        for r in rows:
            r.seen = len(r.tokens)
        return drafts, [torch.stack(d) if d else None for d in dists]

    def rollback(self, b: int, row: Row, kept_drafts: int, steps: int) -> None:
        """Row b kept `kept_drafts` drafts; the drafter fed the first `steps - 1` of its drafts."""
        fed = min(kept_drafts, steps - 1)
        self.cache.forget(b, self.first_slot + 1 + fed)
        row.seen += fed


def decode_batch(target: PreTrainedModel, drafter, rows: list[Row], k: int, eos: set[int], metrics: list,
                 batch, clock) -> tuple[bool, str | None]:
    """Decode every row to EOS or its max_new_tokens on arm (drafter, k); drafter None means OFF.

    Fills `metrics` (one GenerationMetrics per row) and `batch` (the whole batch's rounds,
    drafter steps and times). Returns (fell_back, error): a drafter failure
    turns the rest of the batch to OFF and every request is still served.
    """
    device = target.device
    started = clock()
    target_cache = BatchCache(target, len(rows))
    ids, live = _block([r.tokens for r in rows], device, right=True)
    logits = target_cache.forward(ids, _positions(live, [0] * len(rows)), live, last_only=True)[:, -1]
    for b, r in enumerate(rows):
        r.tokens.append(_pick(logits[b], r.sampling, r.generator))
        r.done = r.tokens[-1] in eos or r.remaining <= 0
    batch_drafter = None
    fell_back, error = False, None
    lookup = drafter.lookup if isinstance(drafter, HybridDrafter) else None
    model = model_drafter_of(drafter)
    if model is not None:
        target_done = clock()
        try:
            batch_drafter = BatchDrafter(model, rows)
        except Exception as exc:  # speculation must never lose a request
            drafter, fell_back, error = None, True, f"{type(exc).__name__}: {exc}"
        batch.draft_prefill_s = clock() - target_done
    now = clock()
    batch.prefill_s = now - started
    for m in metrics:
        m.prefill_s, m.draft_prefill_s = batch.prefill_s, batch.draft_prefill_s
    now += _stream(rows, [r.prompt_len for r in rows], batch, prompt=True)
    live_rows = list(range(len(rows)))  # indexes into rows/metrics, in batch order
    _drop_finished(rows, live_rows, metrics, target_cache, batch_drafter, now - started - batch.stream_s)
    while live_rows:
        active = [rows[i] for i in live_rows]
        ks = [max(0, min(k, r.remaining - 1)) if drafter is not None else 0 for r in active]
        drafts, qs = [[] for _ in active], [None] * len(active)
        steps = 0  # batched drafter steps this round
        from_model = [False] * len(active)
        if drafter is not None and max(ks) > 0:
            try:
                if batch_drafter is not None:
                    if lookup is not None:
                        drafts = [lookup.propose(r.tokens, kb, r.sampling, r.generator)[0] for r, kb in zip(active, ks)]
                    from_model = [kb > 0 and not d for d, kb in zip(drafts, ks)]
                    model_ks = [kb if m else 0 for kb, m in zip(ks, from_model)]
                    if max(model_ks) > 0:
                        model_drafts, model_qs = batch_drafter.propose(active, model_ks)
                        steps = max(model_ks)
                        for b in range(len(active)):
                            if from_model[b]:
                                drafts[b], qs[b] = model_drafts[b], model_qs[b]
                else:
                    drafts = [drafter.propose(r.tokens, kb, r.sampling, r.generator)[0] for r, kb in zip(active, ks)]
            except Exception as exc:
                drafter, batch_drafter, fell_back, steps = None, None, True, 0
                error = f"{type(exc).__name__}: {exc}"
                drafts, qs = [[] for _ in active], [None] * len(active)
        before_verify = clock()
        batch.draft_s += before_verify - now
        for i in live_rows:
            metrics[i].draft_s += before_verify - now
        ids, live = _block([[r.tokens[-1], *d] for r, d in zip(active, drafts)], device, right=False)
        positions = _positions(torch.ones_like(live), [len(r.tokens) - 1 for r in active])
        first_slot = target_cache.slots
        logits = target_cache.forward(ids, positions, live)
        prevs = [len(r.tokens) for r in active]
        for b, (i, r, d) in enumerate(zip(live_rows, active, drafts)):
            if r.sampling.greedy:
                n, nxt = verify_greedy(logits[b, : len(d) + 1], d)
            else:
                n, nxt = verify_sampled(probabilities(logits[b, : len(d) + 1], r.sampling), d, qs[b], r.generator)
            target_cache.forget(b, first_slot + 1 + n)
            if steps:  # a lookup row kept none of the model's drafts, only its catch-up
                batch_drafter.rollback(b, r, n if from_model[b] else 0, steps)
            prev = len(r.tokens)
            r.tokens.extend(d[:n])
            r.tokens.append(nxt)
            for j, t in enumerate(r.tokens[prev:]):
                if t in eos:
                    del r.tokens[prev + j + 1:]
                    r.done = True
                    break
            r.done = r.done or r.remaining <= 0
            m = metrics[i]
            m.rounds += 1
            m.drafted += len(d)
            m.accepted += n
            for j in range(len(d)):
                m.drafted_per_position[j] += 1
                m.accepted_per_position[j] += j < n
        now = clock()
        batch.rounds += 1
        round_steps = max(steps, *map(len, drafts))  # as far as the longest row drafted
        batch.draft_steps += round_steps
        batch.draft_rounds += round_steps > 0
        batch.add_verify(ids.shape[1], now - before_verify)
        for i in live_rows:
            metrics[i].add_verify(ids.shape[1], now - before_verify)
        now += _stream(active, prevs, batch)
        _drop_finished(rows, live_rows, metrics, target_cache, batch_drafter, now - started - batch.stream_s)
    batch.total_s = now - started - batch.stream_s
    batch.new_tokens = sum(len(r.tokens) - r.prompt_len for r in rows)
    return fell_back, error


def _stream(rows: list[Row], starts: list[int], batch, prompt: bool = False) -> float:
    """Hand each row's tokens from `starts` on (after its prompt, with `prompt`) to its streamer;
    the seconds that took, which are the callers' and stay out of the batch's times. A row whose
    streamer raises is done."""
    began = time.perf_counter()
    for r, start in zip(rows, starts):
        if r.streamer is not None:
            first = put_prompt(r.streamer, r.tokens[:start]) if prompt else None
            r.stream_error = first or put_tokens(r.streamer, r.tokens[start:])
            r.done = r.done or r.stream_error is not None
    spent = time.perf_counter() - began
    batch.stream_s += spent
    return spent


def _drop_finished(rows, live_rows: list[int], metrics, target_cache: BatchCache, batch_drafter, elapsed: float):
    keep = [b for b, i in enumerate(live_rows) if not rows[i].done]
    for i in live_rows:
        if rows[i].done:
            metrics[i].total_s = elapsed
    if len(keep) == len(live_rows):
        return
    live_rows[:] = [live_rows[b] for b in keep]
    if keep:
        target_cache.select(keep)
        if batch_drafter is not None:
            batch_drafter.cache.select(keep)


def _pick(logits: torch.Tensor, sampling: SamplingParams, generator) -> int:
    if sampling.greedy:
        return int(logits.argmax())
    return sample(probabilities(logits, sampling), generator)
