"""The eager paths' KV cache: transformers' DynamicCache, grown into preallocated buffers.

DynamicCache appends a step's keys and values with `torch.cat`, which copies the whole cache
every step: per step O(length), per request O(length^2). On the 2-core CPU that copy was 43 %
of a batch-of-64 verify step (cProfile: 1.42 s of torch.cat in a 5.0 s OFF batch). Here each
layer writes into a buffer whose capacity doubles when full, and hands attention a view of
the filled part, so a step copies only its own tokens. Cropping (rejected drafts) moves the
length back; the next step overwrites the rejected entries. StaticCache avoids the copy too,
but every step attends over its whole preallocated length, which costs more than it saves on
the eager path (see runner.py).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

MIN_CAPACITY = 256  # positions; doubled as needed


class GrowingLayer(DynamicLayer):
    """A DynamicLayer whose `keys`/`values` are views into buffers with room to grow.

    Covers what the engine's loops do to a cache (append, crop, drop and add rows); beam-search
    reordering and row repetition are DynamicLayer's and do not know the buffers.
    """

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.length = 0
        self._keys = self._values = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self.length, self.length + key_states.shape[-2]
        if self._keys is None or end > self._keys.shape[-2]:
            self._reallocate(key_states.shape[0], max(2 * end, MIN_CAPACITY), key_states)
        self._keys[..., start:end, :] = key_states
        self._values[..., start:end, :] = value_states
        self._set_length(end)
        return self.keys, self.values

    def _reallocate(self, batch: int, capacity: int, like: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """New buffers of `capacity` positions holding the filled part (of `rows` only, if given)."""
        keys = like.new_empty((batch, like.shape[1], capacity, like.shape[-1]))
        values = torch.empty_like(keys)
        if self.length:
            old_keys, old_values = self.keys, self.values
            if rows is not None:
                old_keys, old_values = old_keys[rows], old_values[rows]
            keys[..., :self.length, :] = old_keys
            values[..., :self.length, :] = old_values
        self._keys, self._values = keys, values

    def _set_length(self, length: int) -> None:
        self.length = length
        self.keys, self.values = self._keys[..., :length, :], self._values[..., :length, :]

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes the number of positions to remove as a negative int, got {tokens_to_remove}")
        if tokens_to_remove and self.is_initialized:
            self._set_length(max(0, self.length + tokens_to_remove))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep these rows (finished requests leave a batch). Rows kept in order move up in place,
        only those behind the first one dropped, and only their filled part; a new buffer for
        every drop cost 4 ms a layer in a batch of 64 (0.43 s of a 4.8 s batch)."""
        if self.get_seq_length() == 0:
            return
        rows = indices.tolist()
        if rows != sorted(set(rows)):
            self._reallocate(len(rows), self._keys.shape[-2], self._keys, rows=indices)
        else:
            first = next((j for j, row in enumerate(rows) if row != j), len(rows))
            if first < len(rows):
                moving = indices[first:]
                self._keys[first:len(rows), :, :self.length] = self._keys[moving, :, :self.length]
                self._values[first:len(rows), :, :self.length] = self._values[moving, :, :self.length]
            self._keys, self._values = self._keys[:len(rows)], self._values[:len(rows)]
        self._set_length(self.length)

    def append_rows(self, other: GrowingLayer) -> None:
        """Put `other`'s rows after these (requests joining a batch), the shorter side's positions
        padded with zeros up to the longer length; the caller's mask hides the padding (zeros,
        not empty memory: a masked NaN would still poison attention's weighted sum)."""
        length = max(self.length, other.length)
        capacity = max(self._keys.shape[-2], other._keys.shape[-2])
        rows = self._keys.shape[0]
        keys = self._keys.new_zeros((rows + other._keys.shape[0], *self._keys.shape[1:-2], capacity,
                                     self._keys.shape[-1]))
        values = torch.zeros_like(keys)
        for buffer, mine, theirs in ((keys, self.keys, other.keys), (values, self.values, other.values)):
            buffer[:rows, ..., :self.length, :] = mine
            buffer[rows:, ..., :other.length, :] = theirs
        self._keys, self._values = keys, values
        self._set_length(length)


class GrowingCache(DynamicCache):
    """DynamicCache with GrowingLayer for its full-attention layers (sliding-window layers unchanged)."""

    def __init__(self, config) -> None:
        super().__init__(config=config)
        self.layers = [GrowingLayer() if type(layer) is DynamicLayer else layer for layer in self.layers]
