"""Drafters propose K tokens for the target to verify.

The interface is two calls, in the spirit of transformers' candidate generators:
`propose` returns draft tokens (and their distribution, if the drafter has one), and
`rollback` tells the drafter how much of what it has seen the target actually kept, so a
drafter with a KV cache trims it instead of recomputing the prefix. New drafter kinds
(early-exit self-drafting, Medusa heads, ...) implement the same protocol.
"""

from __future__ import annotations

from typing import Protocol

import torch
from transformers import DynamicCache, PreTrainedModel, StaticCache

from engine.sampling import SamplingParams, probabilities, sample


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
        generator: torch.Generator | None,
    ) -> tuple[list[int], torch.Tensor | None]:
        """Up to k draft tokens following `tokens`, and their q distribution [len, V] or None."""
        ...

    def rollback(self, valid_length: int) -> None:
        """`tokens[:valid_length]` from the last `propose` are now committed; forget the rest."""
        ...


def new_cache(model: PreTrainedModel, max_length: int, static: bool) -> DynamicCache | StaticCache:
    """A static cache is preallocated once per request; a dynamic one grows and is cropped."""
    if static:
        return StaticCache(config=model.config, max_cache_len=max_length)
    return DynamicCache(config=model.config)


def truncate_cache(cache: DynamicCache | StaticCache, length: int) -> None:
    """Forget cached positions beyond `length` (rejected drafts); the prefix is never recomputed.

    A static cache just moves its write position back: the next round overwrites the rejected
    entries, and the causal mask hides them until then (gpt-fast's trick).
    """
    if isinstance(cache, StaticCache):
        for layer in cache.layers:
            if layer.is_initialized:
                layer.cumulative_length.fill_(length)
        return
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


class ModelDrafter:
    """A small causal LM sharing the target's vocabulary, with its own persistent KV cache."""

    def __init__(self, model: PreTrainedModel, tokenizer=None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.static_cache = False  # the engine sets this to match its own cache kind
        self._cache: DynamicCache | StaticCache | None = None
        self._seen = 0  # positions held in the cache

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def max_length(self) -> int | None:
        return getattr(self.model.config, "max_position_embeddings", None)

    def begin(self, prompt: torch.Tensor, max_length: int) -> None:
        self._cache = new_cache(self.model, max_length, self.static_cache)
        self.model(prompt[None], past_key_values=self._cache, use_cache=True, logits_to_keep=1)
        self._seen = prompt.numel()

    def propose(self, tokens, k, params, generator):
        device = self.model.device
        step = torch.tensor([tokens[self._seen :]], device=device)
        draft: list[int] = []
        dists = []
        for _ in range(k):
            positions = torch.arange(self._seen, self._seen + step.shape[1], device=device)
            logits = self.model(
                step, past_key_values=self._cache, use_cache=True, logits_to_keep=1,
                cache_position=positions, position_ids=positions[None],
            ).logits[0, -1]
            self._seen += step.shape[1]
            if params.greedy:
                token = int(logits.argmax())
            else:
                q = probabilities(logits, params)
                token = sample(q, generator)
                dists.append(q)
            draft.append(token)
            step = torch.tensor([[token]], device=device)
        return draft, (torch.stack(dists) if dists else None)

    def rollback(self, valid_length: int) -> None:
        if valid_length < self._seen:
            truncate_cache(self._cache, valid_length)
            self._seen = valid_length


class NGramDrafter:
    """Prompt lookup: propose what followed the latest earlier match of the last n tokens.

    No model and no distribution (a point mass for rejection sampling). It shines when the
    output copies from the prompt (edits, summaries quoting the source, code refactors).
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.vocab_size = None  # any vocabulary: it only copies tokens it has seen
        self.max_length = None

    def begin(self, prompt: torch.Tensor, max_length: int) -> None:
        pass

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
