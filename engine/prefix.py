"""Prompt prefixes kept across requests (vLLM's automatic prefix caching, SGLang's radix cache).

Requests often start alike: a system prompt, few-shot examples, a document asked several
questions, a chat's earlier turns. A position's keys and values depend only on the tokens up to
it, so a model that kept them from an earlier request prefills only what follows. Each model
(the target, each model drafter) keeps its own `PrefixCache` of whole prompts' keys and values
(and of a finished request's prompt and output: a chat's next turn starts with both), the least
recently used evicted beyond `capacity` tokens; a lookup takes the longest prefix any
kept prompt shares with the new one, whatever the kept prompt went on with (a radix tree's
answer, found by comparing the few kept prompts that start alike).

What is reused:
- at most all but the prompt's last token: the first output token is drawn from the last
  position's logits, so that position is always fed;
- at least MIN_REUSE tokens, vLLM's block size: a BOS alone is shared by every prompt, and a
  short hit saves less than it costs to copy;
- not for a prompt scored for its logprobs (every position's logits are needed; it is kept),
  nor for a model with recurrent layers (a state is not per position: nothing is kept).
Feeding the rest of a prompt after kept positions computes what feeding it whole computes, but
float matmuls split differently, so logits may differ in their last bits (as with chunked
prefill); the tests hold greedy outputs identical to the target's own.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [1, heads, positions, width]

MIN_REUSE = 16


def shared_length(a: Sequence[int], b: Sequence[int], most: int) -> int:
    """How many leading tokens `a` and `b` share, at most `most`."""
    n = min(len(a), len(b), most)
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def shared_starts(seqs: list[list[int]], rows: list[int]) -> list[tuple[list[int], list[int]]]:
    """Clusters of `rows` (indexes into `seqs`) whose sequences start alike for at least
    MIN_REUSE tokens (all but each one's last token at most), each with the start its rows share:
    requests arriving together with one system prompt, which a batch prefills once."""
    order = sorted(rows, key=lambda i: seqs[i])  # lexicographic: a cluster's rows are neighbours
    out, cluster, length = [], order[:1], 0
    for before, i in zip(order, order[1:]):
        n = shared_length(seqs[before], seqs[i], min(len(seqs[before]), len(seqs[i])) - 1)
        if n >= MIN_REUSE:
            cluster.append(i)
            length = min(length, n) if len(cluster) > 2 else n
            continue
        if len(cluster) > 1:
            out.append((seqs[cluster[0]][:length], cluster))
        cluster = [i]
    if len(cluster) > 1:
        out.append((seqs[cluster[0]][:length], cluster))
    return out


class PrefixCache:
    """One model's kept prompts, keyed by their tokens, oldest use first."""

    def __init__(self, capacity: int) -> None:
        if capacity < MIN_REUSE:
            raise ValueError(f"a prefix cache must hold at least {MIN_REUSE} tokens, not {capacity}")
        self.capacity = capacity
        self.tokens = 0  # held, summed over the kept prompts
        self._kept: OrderedDict[tuple[int, ...], KV] = OrderedDict()
        self._by_start: dict[tuple[int, ...], set[tuple[int, ...]]] = {}  # first MIN_REUSE tokens -> prompts

    def __len__(self) -> int:
        return len(self._kept)

    def lookup(self, prompt: list[int]) -> tuple[int, KV | None]:
        """The most positions of `prompt` a kept prompt holds (0 or at least MIN_REUSE, all but
        the last token at most), and their keys and values (views: copy before writing)."""
        most = len(prompt) - 1
        if most < MIN_REUSE:
            return 0, None
        best, source, prompt = 0, None, tuple(prompt)
        for kept in self._by_start.get(prompt[:MIN_REUSE], ()):
            n = shared_length(kept, prompt, most)
            if n > best:
                best, source = n, kept
        if source is None:
            return 0, None
        self._kept.move_to_end(source)
        return best, [(k[..., :best, :], v[..., :best, :]) for k, v in self._kept[source]]

    def insert(self, prompt: list[int], kv: Callable[[], KV]) -> None:
        """Keep `prompt`'s keys and values, `kv()` (called only if they are not held already: a
        kept prompt that `prompt` starts is freshened instead; out of memory for the copy, nothing
        is kept). Kept prompts that `prompt` extends are dropped: it holds all they could give."""
        key = tuple(prompt)
        if len(key) < MIN_REUSE or len(key) > self.capacity:
            return
        bucket = self._by_start.setdefault(key[:MIN_REUSE], set())
        for kept in bucket:
            if len(kept) >= len(key) and kept[:len(key)] == key:
                self._kept.move_to_end(kept)
                return
        try:
            value = kv()
        except (torch.OutOfMemoryError, MemoryError):  # keeping only saves work: no request fails for it
            return
        for kept in [k for k in bucket if k == key[:len(k)]]:
            self._drop(kept)
        self._kept[key] = value
        self._by_start.setdefault(key[:MIN_REUSE], set()).add(key)
        self.tokens += len(key)
        while self.tokens > self.capacity:
            self._drop(next(iter(self._kept)))

    def clear(self) -> None:
        """Keep nothing (a benchmark's cases each start cold)."""
        self._kept.clear()
        self._by_start.clear()
        self.tokens = 0

    def _drop(self, key: tuple[int, ...]) -> None:
        del self._kept[key]
        bucket = self._by_start[key[:MIN_REUSE]]
        bucket.discard(key)
        if not bucket:
            del self._by_start[key[:MIN_REUSE]]
        self.tokens -= len(key)
