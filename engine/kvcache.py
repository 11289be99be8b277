"""The eager paths' KV cache: transformers' DynamicCache, grown into preallocated buffers.

DynamicCache appends a step's keys and values with `torch.cat`, which copies the whole cache
every step: per step O(length), per request O(length^2). Here each
layer writes into a buffer whose capacity doubles when full, and hands attention a view of
the filled part, so a step copies only its own tokens. Cropping (rejected drafts) moves the
length back; the next step overwrites the rejected entries. StaticCache avoids the copy too,
but every step attends over its whole preallocated length, which costs more than it saves on
the eager path (see runner.py).

Sliding-window layers keep their whole history here, in both kinds of cache: transformers'
own sliding layers keep only the last window, so a request longer than the window could not
roll back its rejected drafts (DynamicSlidingWindowLayer.crop refuses; a static ring buffer
would have overwritten what the rollback needs). The window is applied by the masks instead.
Chunked-attention layers (Llama 4) are cached by the same classes, their chunk standing for
the window; only their masks differ.

Hybrid models put recurrent layers between attention layers (linear attention in Qwen3-Next and
Qwen3.5, Mamba-2 mixers in Falcon-H1 and Bamba, short convolutions in LFM2). Such a layer holds
one state, not an entry per position, so no crop can take rejected drafts back out of it
(transformers' `crop` refuses). `StateCheckpoint` keeps those states as
they were before a round's first step; a rollback restores them, crops the attention layers,
and feeds the kept tokens again (one more forward in a round that rejected drafts). Static and
compiled caches do not take these layers (`recurrent_kinds` tells which a model has).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, StaticCache
from transformers.cache_utils import (
    DYNAMIC_LAYER_TYPE_MAPPING,
    CacheLayerMixin,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionCacheLayerMixin,
    StaticLayer,
    StaticSlidingWindowLayer,
    get_layer_types_and_kwargs,
)

MIN_CAPACITY = 256  # positions; doubled as needed


class GrowingLayer(DynamicLayer):
    """A DynamicLayer whose `keys`/`values` are views into buffers with room to grow.

    Covers what the engine's loops do to a cache (append, crop, drop, add and repeat rows);
    beam-search reordering is DynamicLayer's and does not know the buffers.
    """

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.length = 0
        self.rows = key_states.shape[0]  # rows in use; the buffers may hold more (rows that left)
        self._keys = self._values = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self.length, self.length + key_states.shape[-2]
        if self._keys is None or end > self._keys.shape[-2]:
            rows = self.rows if self._keys is None else self._keys.shape[0]  # keeping rows that left for joiners
            self._reallocate(rows, max(2 * end, MIN_CAPACITY), key_states, value_states)
        self._keys[:self.rows, ..., start:end, :] = key_states
        self._values[:self.rows, ..., start:end, :] = value_states
        self._set_length(end)
        return self.keys, self.values

    def _reallocate(self, rows: int, capacity: int, keys_like: torch.Tensor, values_like: torch.Tensor) -> None:
        """New buffers of `rows` x `capacity` positions holding the filled part. Zeros, not empty
        memory: padding that a mask hides must not be NaN, which would still poison attention.
        Keys and values may differ in heads and width (DeepSeek's latent attention caches its
        keys' two parts in them)."""
        keys, values = (like.new_zeros((rows, like.shape[1], capacity, like.shape[-1]))
                        for like in (keys_like, values_like))
        if self.length:
            keys[:self.rows, ..., :self.length, :] = self.keys
            values[:self.rows, ..., :self.length, :] = self.values
        self._keys, self._values = keys, values

    def _set_length(self, length: int) -> None:
        self.length = length
        self.keys, self.values = self._keys[:self.rows, ..., :length, :], self._values[:self.rows, ..., :length, :]

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes the number of positions to remove as a negative int, got {tokens_to_remove}")
        if tokens_to_remove and self.is_initialized:
            self._set_length(max(0, self.length + tokens_to_remove))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep these rows, in this order (finished requests leave a batch; a row repeated is
        a prompt prefilled once for the requests that share it), in place: only rows whose place
        changes are copied, and only their filled part, since a new buffer for every drop costs a
        copy of every layer; BatchRun fills each hole with a row
        from the end, so a request leaving copies one row."""
        if not self.is_initialized or self._keys is None:
            return
        if len(indices) > self._keys.shape[0]:
            self._reallocate(len(indices), self._keys.shape[-2], self._keys, self._values)
        moved = [j for j, row in enumerate(indices.tolist()) if row != j]
        if moved:
            to = torch.tensor(moved, device=indices.device)
            self._keys[to, :, :self.length] = self._keys[indices[to], :, :self.length]
            self._values[to, :, :self.length] = self._values[indices[to], :, :self.length]
        self.rows = len(indices)
        self._set_length(self.length)

    def keep_slots(self, index: torch.Tensor) -> None:
        """Row b keeps its slots `index[b]` [B, width], in that order, as its first `width`
        (a batch dropping its holes, batch.BatchCache.compact)."""
        for buffer, filled in ((self._keys, self.keys), (self._values, self.values)):
            gather = index[:, None, :, None].expand(-1, filled.shape[1], -1, filled.shape[-1])
            buffer[:self.rows, ..., :index.shape[1], :] = filled.gather(2, gather)
        self._set_length(index.shape[1])

    def append_rows(self, other: GrowingLayer) -> None:
        """Put `other`'s rows after these (requests joining a batch), in rows that left the buffers
        if there are enough, the shorter side's positions padded with zeros up to the longer
        length (the caller's mask hides the padding)."""
        rows, length = self.rows + other.rows, max(self.length, other.length)
        if rows > self._keys.shape[0] or length > self._keys.shape[-2]:
            self._reallocate(max(rows, self._keys.shape[0]), max(self._keys.shape[-2], other._keys.shape[-2]),
                             self._keys, self._values)
        for buffer, theirs in ((self._keys, other.keys), (self._values, other.values)):
            buffer[:self.rows, ..., self.length:length, :] = 0
            buffer[self.rows:rows, ..., :other.length, :] = theirs
            buffer[self.rows:rows, ..., other.length:length, :] = 0
        self.rows = rows
        self._set_length(length)


class GrowingWindowLayer(GrowingLayer):
    """A sliding-window attention layer's cache that keeps its whole history.

    DynamicSlidingWindowLayer keeps only the last window of positions, so once a request is
    longer than the window, rejected drafts cannot be rolled back (its `crop` refuses), and
    its masks are sized for that window, not for a batch's slots. This layer keeps every
    position, as a full-attention layer does, and reports itself sliding: the model builds
    this layer's mask with the window (over absolute positions, `kv_offset` 0), and a batch's
    own masks apply the window from each slot's position (see batch.BatchCache). The cost is
    memory: the whole history rather than the window, like a full-attention layer.
    """

    is_sliding = True

    def __init__(self, sliding_window: int) -> None:
        super().__init__()
        self.sliding_window = sliding_window


class GrowingCache(DynamicCache):
    """DynamicCache with GrowingLayer for its full-attention layers and GrowingWindowLayer for its
    sliding-window ones (any other kind of layer unchanged)."""

    def __init__(self, config) -> None:
        super().__init__(config=config)
        self.layers = [GrowingLayer() if type(layer) is DynamicLayer
                       else GrowingWindowLayer(layer.sliding_window) if type(layer) is DynamicSlidingWindowLayer
                       else layer for layer in self.layers]


class StaticWindowLayer(StaticLayer):
    """A static sliding-window layer as long as the cache (see GrowingWindowLayer): rolled back by
    moving its write position, as a full-attention StaticLayer is; the model's mask applies the window."""

    is_sliding = True

    def __init__(self, max_cache_len: int, sliding_window: int) -> None:
        super().__init__(max_cache_len=max_cache_len)
        self.sliding_window = sliding_window


def rollback_static_cache(config, max_cache_len: int) -> StaticCache:
    """A StaticCache whose sliding-window layers are StaticWindowLayer."""
    cache = StaticCache(config=config, max_cache_len=max_cache_len)
    if not any(type(layer) is StaticSlidingWindowLayer for layer in cache.layers):
        return cache  # full attention only: nothing to replace, and the lookup below is skipped
    _, per_layer = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    cache.layers = [StaticWindowLayer(max_cache_len, kwargs["sliding_window"])
                    if type(layer) is StaticSlidingWindowLayer else layer
                    for layer, kwargs in zip(cache.layers, per_layer, strict=True)]
    return cache


def recurrent_kinds(config) -> set[str]:
    """The kinds of layer of a model that hold a recurrent state instead of one cache entry per
    position (linear attention, short convolutions), as transformers' caches classify them."""
    kinds, _ = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    return {kind for kind in kinds
            if issubclass(DYNAMIC_LAYER_TYPE_MAPPING.get(kind, object), LinearAttentionCacheLayerMixin)}


def uses_alibi(config) -> bool:
    """Whether attention is biased by ALiBi (Bloom always, MPT by default, Falcon when asked).
    transformers works the biases out from cache slots or a 2-D mask, not positions, so such a
    model runs only where slots are positions: the dynamic cache, one request at a time (a
    static cache's length threw Falcon's off)."""
    return (config.model_type == "bloom" or bool(getattr(config, "alibi", False))
            or bool(getattr(getattr(config, "attn_config", None), "alibi", False)))


class StateCheckpoint:
    """The recurrent states of a cache's linear-attention layers at one length, to roll back to."""

    def __init__(self, cache: DynamicCache, length: int) -> None:
        self.cache, self.length = cache, length
        self.states = [(layer, {i: s.clone() for i, s in layer.conv_states.items() if s is not None},
                        {i: s.clone() for i, s in layer.recurrent_states.items() if s is not None})
                       for layer in cache.layers if isinstance(layer, LinearAttentionCacheLayerMixin)]

    def restore(self) -> None:
        """Put the states back as they were, and crop the attention layers back to `length`."""
        for layer, conv, recurrent in self.states:
            for i, state in conv.items():
                layer.conv_states[i].copy_(state)
            for i, state in recurrent.items():
                layer.recurrent_states[i].copy_(state)
        crop_layers(self.cache, self.length)


def crop_layers(cache: DynamicCache, length: int) -> None:
    """Cut every attention layer of `cache` back to `length` positions, each by its own excess:
    a step that failed midway grew only the layers it reached (DynamicCache.crop cuts every
    layer by the first one's). Recurrent states are left alone; a model with none but them
    (Mamba) has nothing to cut."""
    for layer in cache.layers:
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            if isinstance(layer, DynamicLayer):  # a layer with both: its attention part
                extra = DynamicLayer.get_seq_length(layer) - length
                if extra > 0:
                    DynamicLayer.crop(layer, -extra)
        elif isinstance(layer, CacheLayerMixin) and (extra := layer.get_seq_length() - length) > 0:
            layer.crop(-extra)
