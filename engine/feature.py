"""Feature drafting, EAGLE-style: a one-layer head drafts from the target's own hidden states.

Terms, as EAGLE defines them:
- feature f_t: the target's last hidden state at position t, the vector its LM head reads
  (after the final norm), which predicts token x_{t+1};
- pair t: (f_t, x_{t+1}), the head's input at position t: what the target knew at t, and
  the token that was then chosen.

The head (`FeatureHead`) fuses a pair into one vector (a linear layer over [embedding of
x_{t+1}; f_t]), runs one decoder layer over the pairs so far, and predicts f_{t+1}; the
target's own LM head turns that into a distribution over x_{t+2}, and the target's embedding
table embeds the tokens, so the head owns neither. Drafting K tokens is K head steps: the
first over the pairs the target has handed over since the last round (real features), each
later one over (the head's predicted feature, the token it just drafted).

The target computes the features anyway: the engine asks its runner to keep them
(`ModelRunner.keeps_hidden`) and hands over, after every target forward, those of the
positions it committed (`FeatureDrafter.take_features`), so drafting costs no extra target
forward. The head's cache is indexed by position; entries written from predicted features
lie beyond the real ones and are overwritten by the next round's real pairs, as a static
cache overwrites rejected positions.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from engine.arms import MAX_K
from engine.coupled import drawn_equal
from engine.drafters import BatchDrafting, Capabilities, HoldsNothing, lookup_of, reusable
from engine.errors import IncompatibleDrafterError
from engine.replay import ReplayChains, ReplayInputs
from engine.round import Drafts, Row
from engine.runner import COMPILED_CACHE_LEN, CPU_ONE_TOKEN, compile_fixed, first_call_timed
from engine.sampling import SamplingParams, draft_token, probabilities

HEAD_CONFIG = "head.json"
HEAD_WEIGHTS = "head.safetensors"


@dataclass(frozen=True)
class HeadConfig:
    """A head's shape, and the target it was trained for."""

    hidden: int  # the target's hidden size: a feature's width
    vocab_size: int  # the target's vocabulary
    heads: int
    ffn: int
    target_hash: str  # weights_hash of the target's folder (engine/identity.py)
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


@dataclass
class HeadCache:
    """Keys and values [1, heads, length, head_dim] by position; `start`: the first position held.

    Inside a compiled graph (a compiled drafter's, on a cache kept across requests) it is written
    in place at tensor positions and attended whole under a mask, so the graph never depends on
    where a request is; `start_at` holds `start` as a tensor for it. Eager calls attend to the
    positions held only."""

    keys: torch.Tensor
    values: torch.Tensor
    start: int = 0
    start_at: torch.Tensor | None = None

    def begin_at(self, start: int) -> None:
        self.start = start
        if self.start_at is not None:
            self.start_at.fill_(start)


@dataclass
class Features:
    """The target's features by position [length, H], real from position `first` on (a request
    whose prefill reused a kept prefix handed its head features from there)."""

    first: int
    by_position: torch.Tensor


class FeatureHead(nn.Module):
    """[embedding of x_{t+1}; f_t] -> one pre-norm decoder layer (RoPE attention, SwiGLU) -> f_{t+1}."""

    def __init__(self, config: HeadConfig) -> None:
        super().__init__()
        self.config = config
        width = config.hidden
        self.fuse = nn.Linear(2 * width, width)
        self.attention_norm = RMSNorm(width, config.rms_eps)
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.out = nn.Linear(width, width, bias=False)
        self.mlp_norm = RMSNorm(width, config.rms_eps)
        self.gate_up = nn.Linear(width, 2 * config.ffn, bias=False)
        self.down = nn.Linear(config.ffn, width, bias=False)
        self.feature_norm = RMSNorm(width, config.rms_eps)  # features are the target's post-norm states
        inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, config.head_dim, 2).float() / config.head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._rotary: torch.Tensor | None = None  # [positions, 2, head_dim]: cos and sin

    def rotary(self, length: int) -> None:
        """Work out the rotary angles of positions 0..length-1 once (a drafter's, at attach),
        rather than in every step. Kept if it holds that many already: compiled graphs read it."""
        dtype = self.fuse.weight.dtype
        if self._rotary is not None and self._rotary.shape[0] >= length and self._rotary.dtype == dtype \
                and self._rotary.device == self.inv_freq.device:
            return
        angles = torch.arange(length, device=self.inv_freq.device).float()[:, None] * self.inv_freq.float()[None]
        angles = torch.cat([angles, angles], -1)
        self._rotary = torch.stack([angles.cos(), angles.sin()], dim=1).to(dtype)

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                cache: HeadCache | None = None) -> torch.Tensor:
        """Predicted features [B, T, H] from embeds and features [B, T, H] at `positions` [T].
        Without a cache the T positions attend causally among themselves (training); with one,
        they are written at their positions and attend to everything held from `cache.start`."""
        x = self.fuse(torch.cat([embeds, features], dim=-1))
        return self._finish(x, self._attend(self.attention_norm(x), positions, cache))

    def _rotated_qkv(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Queries, keys and values [B, heads, T, head_dim] of x [B, T, H] at `positions` [T]."""
        batch, length, _ = x.shape
        heads, head_dim = self.config.heads, self.config.head_dim
        qkv = self.qkv(x).view(batch, length, 3, heads, head_dim).permute(2, 0, 3, 1, 4)
        if self._rotary is not None:
            rotary = self._rotary[positions]
            cos, sin = rotary[:, 0], rotary[:, 1]
        else:  # training: positions 0..T-1 of fresh windows
            angles = positions[:, None].float() * self.inv_freq[None].float()
            angles = torch.cat([angles, angles], -1)
            cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        qk = qkv[:2] * cos + rotate_half(qkv[:2]) * sin  # queries and keys rotated together: half the ops
        return qk[0], qk[1], qkv[2]

    def _finish(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The layer after attention: x [B, T, H] plus attended [B, heads, T, head_dim] projected, the MLP, the norm."""
        x = x + self.out(attended.transpose(1, 2).reshape(x.shape))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return self.feature_norm(x + self.down(F.silu(gate) * up))

    def chains(self, embeds: torch.Tensor, features: torch.Tensor, starts: torch.Tensor, k: int,
               first: int = 0, still_drafting: Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor] | None = None
               ) -> torch.Tensor:
        """The features [k, R, H] that each of k draft steps reads, for rounds starting after every
        position in `starts` [R], from one pass over the L pairs of a sequence of L + 1 tokens:
        `embeds` [L, H] of x_1..x_L (each pair's token) and `features` [L, H], the target's f_0..f_{L-1}.

        Round r's last committed position is starts[r]: its first step reads the head's output
        at starts[r] - 1 (real pairs up to there), step j its own step j - 1 output, fed with the
        token that followed in the sequence (a kept draft is that token) at position starts[r] +
        j - 1, attending to the real pairs up to starts[r] - 1 and to its own earlier steps, as
        `FeatureDrafter.propose` does one round at a time. What the replay needs: greedy, a
        draft is kept exactly while it equals the token that followed. `first`: the first pair
        a round attends to, as a head whose request reused a kept prefix attended from where
        its features began (pairs before it are not read). `still_drafting(step, rows [n],
        their features [n, H])`: which of those rounds go on to the next step (greedy: those
        whose draft was kept); the others' later features are left zero, and a greedy replay
        computes about a third of the steps."""
        length = features.shape[0]
        held = length - first  # the pairs attended to
        positions = torch.arange(first, length, device=features.device)
        x = self.fuse(torch.cat([embeds[first:], features[first:]], dim=-1))[None]
        q, keys, values = self._rotated_qkv(self.attention_norm(x), positions)
        real = self._finish(x, F.scaled_dot_product_attention(q, keys, values, is_causal=True))[0]  # [held, H]
        scale = self.config.head_dim ** -0.5
        sees = positions[None] < starts[:, None]  # [R, held]: the real pairs before each round's last position
        out = real.new_zeros(k, len(starts), real.shape[-1])
        out[0] = real[starts - 1 - first]
        rows = torch.arange(len(starts), device=features.device)  # the rounds still drafting
        own_keys = keys.new_zeros(k - 1, *keys.shape[:2], len(starts), keys.shape[-1])  # per step: [1, heads, R, d]
        own_values = torch.zeros_like(own_keys)
        for step in range(1, k):
            if still_drafting is not None:
                rows = rows[still_drafting(step - 1, rows, out[step - 1, rows])]
            if not len(rows):
                break
            at = (starts[rows] + step - 1).clamp(max=length - 1)
            x = self.fuse(torch.cat([embeds[at], out[step - 1, rows]], dim=-1))[None]
            q, key, value = self._rotated_qkv(self.attention_norm(x), starts[rows] + step - 1)
            own_keys[step - 1, :, :, rows] = key
            own_values[step - 1, :, :, rows] = value
            scores = torch.einsum("bhrd,bhld->bhrl", q, keys).masked_fill(~sees[rows], float("-inf"))
            own = torch.einsum("bhrd,sbhrd->bhrs", q, own_keys[:step, :, :, rows])
            weights = torch.softmax(torch.cat([scores, own], -1) * scale, dim=-1)
            attended = (torch.einsum("bhrl,bhld->bhrd", weights[..., :held], values)
                        + torch.einsum("bhrs,sbhrd->bhrd", weights[..., held:], own_values[:step, :, :, rows]))
            out[step, rows] = self._finish(x, attended)[0]
        if still_drafting is not None and len(rows):
            still_drafting(k - 1, rows, out[k - 1, rows])
        return out

    def _attend(self, x: torch.Tensor, positions: torch.Tensor, cache: HeadCache | None) -> torch.Tensor:
        q, k, v = self._rotated_qkv(x, positions)
        if cache is None:
            attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif torch.compiler.is_compiling():  # a fixed cache in a graph: no shape may depend on the position
            cache.keys.index_copy_(2, positions, k)
            cache.values.index_copy_(2, positions, v)
            held = torch.arange(cache.keys.shape[2], device=x.device)
            mask = (held[None] <= positions[:, None]) & (held[None] >= cache.start_at)
            attended = F.scaled_dot_product_attention(q, cache.keys, cache.values, attn_mask=mask[None, None])
        else:
            attended = self._attend_held(q, k, v, int(positions[0]), cache)
        return attended

    @staticmethod
    def _attend_held(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first: int, cache: HeadCache) -> torch.Tensor:
        """Eager, one sequence: keys and values [1, heads, T, head_dim] written at positions
        first..first+T-1 of `cache`, and the queries there attending to everything held from
        `cache.start`, the new positions causally."""
        length = q.shape[2]
        end = first + length
        cache.keys[:, :, first:end] = k
        cache.values[:, :, first:end] = v
        keys, values = cache.keys[:, :, cache.start:end], cache.values[:, :, cache.start:end]
        mask = None
        if length > 1:  # the new positions see the held ones and themselves causally
            held = end - cache.start
            mask = torch.ones(length, held, dtype=torch.bool, device=q.device).tril(held - length)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)

    def step_rows(self, embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                  lengths: list[int], caches: list[HeadCache]) -> torch.Tensor:
        """`forward` for several sequences at once (a batch's rows, eager): their pairs laid end
        to end, embeds and features [N, H] at `positions` [N], `lengths[r]` of them row r's, each
        row's at consecutive positions of its own cache. Every layer but attention runs once
        over all N pairs; each row attends to its own cache. Predicted features [N, H]."""
        x = self.fuse(torch.cat([embeds, features], dim=-1))[None]
        q, k, v = self._rotated_qkv(self.attention_norm(x), positions)
        parts, at = [], 0
        for n, cache in zip(lengths, caches):
            parts.append(self._attend_held(q[:, :, at:at + n], k[:, :, at:at + n], v[:, :, at:at + n],
                                           int(positions[at]), cache))
            at += n
        return self._finish(x, torch.cat(parts, dim=2))[0]

    def save(self, folder: Path, report: dict | None = None) -> None:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        save_file({name: t.detach().contiguous() for name, t in self.state_dict().items()}, folder / HEAD_WEIGHTS)
        described = {"config": asdict(self.config), "training": report or {}}
        (folder / HEAD_CONFIG).write_text(json.dumps(described, indent=2))

    @classmethod
    def load(cls, folder: Path) -> FeatureHead:
        folder = Path(folder)
        head = cls(HeadConfig(**json.loads((folder / HEAD_CONFIG).read_text())["config"]))
        head.load_state_dict(load_file(folder / HEAD_WEIGHTS))
        return head.eval()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def feature_head_of(drafter) -> FeatureDrafter | None:
    """The feature drafter that drafts for `drafter` (itself, or a hybrid's inner one), if any."""
    head = drafter if lookup_of(drafter) is None else getattr(drafter, "inner", None)
    return head if isinstance(head, FeatureDrafter) else None


def is_head_folder(path: Path | str) -> bool:
    return (Path(path) / HEAD_CONFIG).is_file()


class FeatureDrafter:
    """Drafts with a `FeatureHead` from the features the engine hands over (see the module docstring).

    The engine attaches it to its target when it is added (`attach`), which refuses a head
    trained for another target. On a compiled engine a greedy round runs as one compiled graph
    (`_greedy_drafts`, one per K): the round's new pairs and its K draft steps. A head step is
    a few dozen small ops, and K + 1 calls through Python cost more than their arithmetic. The
    graph works on a fixed cache kept across requests (`compiled_cache_len` positions, as the
    target's); a longer request, and a sampled or penalised one (whose draws and logit edits
    happen on the host), drafts step by step.

    In a batch each row drafts with a drafter of its own (`for_row`: the same head, its own
    cache and features), a round's head steps running for all its rows at once (`propose_rows`)."""

    capabilities = Capabilities(batch=True, features=True, replay=True)
    model_drafter = None
    lookup = None
    tokenizer = None

    def __init__(self, head: FeatureHead, one_graph: bool = True) -> None:
        self.head = head
        self.one_graph = one_graph  # False: draft step by step on a compiled engine too (to measure what it saves)
        self.vocab_size = head.config.vocab_size
        self.max_length: int | None = None
        self.compile_s: dict[str, float] = {}  # "round of K" -> seconds its graph's first call took
        self._embed: nn.Module | None = None
        self._lm_head: nn.Module | None = None
        self._fixed: HeadCache | None = None  # a compiled drafter's, with `_fixed_features`
        self._fixed_features: torch.Tensor | None = None
        self._loop = None  # `_greedy_drafts`, compiled
        self._cache: HeadCache | None = None
        self._features: torch.Tensor | None = None  # [length, H]: the target's, by position
        self._have = 0  # positions with real features (from `_cache.start` on)
        self._fed = 0  # head positions filled from real pairs
        self._output_start = 0

    @classmethod
    def load(cls, folder: Path | str) -> FeatureDrafter:
        return cls(FeatureHead.load(Path(folder)))

    def attach(self, name: str, target: nn.Module, target_hash: str | None, compiled: bool = False,
               compiled_cache_len: int | None = None) -> None:
        """Draft for `target`: its embedding table and LM head; refuse a head trained for another."""
        config, target_config = self.head.config, target.config
        hidden = getattr(target_config, "hidden_size", None)
        problems = []
        if hidden != config.hidden:
            problems.append(f"hidden size {config.hidden}, the target's is {hidden}")
        if target_config.vocab_size != config.vocab_size:
            problems.append(f"vocabulary size {config.vocab_size}, the target's is {target_config.vocab_size}")
        if target_hash is not None and target_hash != config.target_hash:
            problems.append(f"it was trained for the target with weights {config.target_hash}, this target's are"
                            f" {target_hash}")
        if problems:
            raise IncompatibleDrafterError(f"feature head {name!r} does not fit this target: {'; '.join(problems)}")
        if self._embed is not None:
            if self._embed is target.get_input_embeddings() and (self._fixed is not None) == compiled:
                return  # attached already (a hybrid drafting with the same head, say)
            raise IncompatibleDrafterError(f"feature drafter {name!r} drafts for another engine already: give each"
                                           " engine its own FeatureDrafter(head)")
        self.head.to(device=target.device, dtype=target.dtype)
        self._embed, self._lm_head = target.get_input_embeddings(), target.get_output_embeddings()
        self.max_length = getattr(target_config, "max_position_embeddings", None)
        self.head.rotary((self.max_length or 32768) + MAX_K + 1)  # a round's drafts reach past the last position
        if compiled:
            length = min(compiled_cache_len or COMPILED_CACHE_LEN, self.max_length or COMPILED_CACHE_LEN)
            self._fixed, self._fixed_features = self._buffers(length)
            self._fixed.start_at = torch.zeros((), dtype=torch.long, device=target.device)
            self._loop = compile_fixed(self._greedy_drafts, target.device)

    def for_row(self) -> FeatureDrafter:
        """A drafter with this one's head and target and a cache of its own (eager), for one row of a batch."""
        if self._embed is None:
            raise RuntimeError("a feature drafter drafts only once an engine has attached it to its target")
        row = FeatureDrafter(self.head)
        row._embed, row._lm_head, row.max_length = self._embed, self._lm_head, self.max_length
        return row

    def for_batch(self, target: nn.Module, reuse: BatchDrafting | None = None) -> BatchDrafting:
        """A drafter of this head's for each row of a batch, its head steps for all rows at once."""
        return reusable(reuse, self) or HeadBatch(self, target)

    def replay_chains(self, inputs: ReplayInputs) -> ReplayChains | None:
        chains = feature_chains(self, inputs)
        return ReplayChains(chains) if chains is not None else None

    def _buffers(self, length: int) -> tuple[HeadCache, torch.Tensor]:
        param = next(self.head.parameters())
        shape = (1, self.head.config.heads, length, self.head.config.head_dim)
        features = param.new_zeros(length, self.head.config.hidden)
        return HeadCache(param.new_zeros(shape), param.new_zeros(shape)), features

    def begin(self, prompt: torch.Tensor, max_length: int) -> None:
        if self._embed is None:
            raise RuntimeError("a feature drafter drafts only once an engine has attached it to its target")
        if self._fixed is not None and max_length <= self._fixed.keys.shape[2]:
            self._cache, self._features = self._fixed, self._fixed_features
        else:
            self._cache, self._features = self._buffers(max_length)
        self._have = self._fed = 0
        self._output_start = prompt.numel()

    def take_features(self, start: int, hidden: torch.Tensor) -> None:
        """The target's features [T, H] of committed positions start..start+T-1 (a prefill may
        begin past 0 where a kept prefix spared computing the rest)."""
        if self._have == 0:
            self._cache.begin_at(start)
            self._fed = start
        elif start > self._have:
            raise RuntimeError(f"features from position {start} leave a gap after {self._have}")
        self._features[start:start + hidden.shape[0]] = hidden
        self._have = start + hidden.shape[0]
        self._fed = min(self._fed, start)

    def propose(self, tokens, k, params: SamplingParams, generator):
        last = len(tokens) - 1  # pairs t < last are known: f_t and x_{t+1} are both committed
        if self._have < last:
            raise RuntimeError(f"features end at position {self._have}, drafting needs them up to {last}")
        window = last - (k + 1)  # a compiled round feeds the last k + 1 pairs, the new ones among them
        if self._cache is self._fixed and self.one_graph and params.greedy and not params.adjusts_logits \
                and window >= self._cache.start:
            if self._fed < window:  # more new pairs than that (after the prompt): the rest first
                self._feed(tokens, window)
            self._fed = last
            return self._compiled_round(tokens, last, k).tolist(), None
        return self.propose_rows([self], [tokens], [k], [params], [generator])[0]

    @staticmethod
    def propose_rows(drafters: list[FeatureDrafter], tokens: list[list[int]], ks: list[int],
                     params: list[SamplingParams], generators: list) -> list[tuple[list[int], torch.Tensor | None]]:
        """The eager drafts of several rows (a batch's, each with a drafter of one head's: `for_row`;
        `propose` drafts one request as a row of one), with a head step for all rows together: first each
        row's real pairs handed over since its last round, then one draft step a row for the rows
        still drafting. One call per step rather than one per row and step, whose calls would
        cost more than the verify."""
        if not drafters:
            return []
        first = drafters[0]
        head, embed, lm_head = first.head, first._embed, first._lm_head
        lasts = [len(t) - 1 for t in tokens]  # pairs before each row's last position are known
        for drafter, last in zip(drafters, lasts):
            if drafter._have < last:
                raise RuntimeError(f"features end at position {drafter._have}, drafting needs them up to {last}")
        device = first._features.device
        lengths = [last - d._fed for d, last in zip(drafters, lasts)]
        positions = torch.cat([torch.arange(d._fed, last, device=device) for d, last in zip(drafters, lasts)])
        new_tokens = torch.tensor([t for d, row, last in zip(drafters, tokens, lasts)
                                   for t in row[d._fed + 1:last + 1]], device=device)
        features = torch.cat([d._features[d._fed:last] for d, last in zip(drafters, lasts)])
        out = head.step_rows(embed(new_tokens), features, positions, lengths, [d._cache for d in drafters])
        ends = torch.tensor(lengths, device=device).cumsum(0) - 1
        feature = out[ends]  # [R, H]: each row's prediction at its last position
        for drafter, last in zip(drafters, lasts):
            drafter._fed = last
        drafts: list[list[int]] = [[] for _ in drafters]
        dists: list[list[torch.Tensor]] = [[] for _ in drafters]
        going = list(range(len(drafters)))  # rows still drafting, in the order of `feature`'s rows
        for step in range(max(ks, default=0)):
            logits = lm_head(feature)
            going_on, chosen = [], []
            for j, r in enumerate(going):
                token, q = draft_token(logits[j], tokens[r] + drafts[r], drafters[r]._output_start, params[r],
                                       generators[r])
                drafts[r].append(token)
                dists[r] += [] if q is None else [q]
                if step + 1 < ks[r]:
                    going_on.append(r)
                    chosen.append((j, token))
            if not going_on:
                break
            rows = torch.tensor([j for j, _ in chosen], device=device)
            at = torch.tensor([lasts[r] + step for r in going_on], device=device)
            feature = head.step_rows(embed(torch.tensor([t for _, t in chosen], device=device)), feature[rows], at,
                                     [1] * len(going_on), [drafters[r]._cache for r in going_on])
            going = going_on
        return [(d, torch.stack(q) if q else None) for d, q in zip(drafts, dists)]

    def _feed(self, tokens: list[int], end: int) -> torch.Tensor:
        """Feed the real pairs from `_fed` to `end` (exclusive); the feature predicted at the last [H]."""
        positions = torch.arange(self._fed, end, device=self._features.device)
        new_tokens = torch.tensor(tokens[self._fed + 1:end + 1], device=positions.device)
        feature = self.head(self._embed(new_tokens)[None], self._features[self._fed:end][None], positions,
                            self._cache)[0, -1]
        self._fed = end
        return feature

    def _compiled_round(self, tokens: list[int], last: int, k: int) -> torch.Tensor:
        device = self._features.device
        positions = torch.arange(last - k - 1, last, device=device)
        fed = torch.tensor(tokens[last - k:last + 1], device=device)
        settings = torch._inductor.config.patch(CPU_ONE_TOKEN) if device.type == "cpu" else contextlib.nullcontext()
        return first_call_timed(self.compile_s, f"round of {k}", settings, lambda: self._loop(fed, positions, k))

    def _greedy_drafts(self, tokens: torch.Tensor, positions: torch.Tensor, k: int) -> torch.Tensor:
        """A greedy round as one graph: the pairs at `positions` [k + 1] (the features held there
        and `tokens` [k + 1], the token after each), again where already fed (the same keys and
        values, rewritten), then K drafts [K], draft j's step at the position after the last + j."""
        features = self._fixed_features.index_select(0, positions)
        feature = self.head(self._embed(tokens)[None], features[None], positions, self._cache)[0, -1]
        drafts = []
        for step in range(k):
            token = self._lm_head(feature).argmax(-1)
            drafts.append(token)
            if step + 1 < k:
                position = positions[-1:] + 1 + step
                feature = self.head(self._embed(token.view(1, 1)), feature.view(1, 1, -1), position,
                                    self._cache)[0, -1]
        return torch.stack(drafts)

    def replay_logits(self, features: Features, sequence: list[int], start: int, k: int) -> torch.Tensor:
        """Logits [k, R, V] of the k drafts of each round that would draft sequence[t] first, for t
        = start..len(sequence) - 1, every earlier draft of a round taken as the token that followed
        (`FeatureHead.chains`); `features`: the target's over the sequence, up to its last position
        but one at least."""
        return self._lm_head(self.head.chains(*self._replay_inputs(features, sequence, start), k, features.first))

    def replay_kept(self, features: Features, sequence: list[int], start: int, k: int) -> torch.Tensor:
        """Greedy `replay_logits`: [k, R] 1.0 where draft j of the round from start + r would be
        kept (it and every earlier draft of the round equal the tokens that followed), else 0.0."""
        embeds, pairs, starts = self._replay_inputs(features, sequence, start)
        following = torch.tensor(sequence[start:] + [-1] * k, device=starts.device)
        kept = torch.zeros(k, len(starts), device=starts.device)

        def still_drafting(step: int, rows: torch.Tensor, drafting: torch.Tensor) -> torch.Tensor:
            hit = self._lm_head(drafting).argmax(-1) == following[rows + step]
            kept[step, rows] = hit.to(kept.dtype)
            return hit

        self.head.chains(embeds, pairs, starts, k, features.first, still_drafting)
        return kept

    def _replay_inputs(self, features: Features, sequence: list[int], start: int) -> tuple[torch.Tensor, ...]:
        """`FeatureHead.chains`' embeds, features and starts for a replay of `sequence` from `start`."""
        pairs = len(sequence) - 1
        if features.by_position.shape[0] < pairs:
            raise ValueError(f"features of {features.by_position.shape[0]} positions, the sequence has {pairs} pairs")
        device = features.by_position.device
        starts = torch.arange(start - 1, pairs, device=device)  # each round's last committed position
        return self._embed(torch.tensor(sequence[1:], device=device)), features.by_position[:pairs], starts

    def served(self) -> Features | None:
        """A copy of the features the last request handed over (a replay of that request reads
        them instead of running the target again); None before any."""
        if self._cache is None or self._have == 0:
            return None
        return Features(self._cache.start, self._features[:self._have].clone())

    def warm_up(self, ks: list[int]) -> None:
        """Compile the round of every K in `ks` before serving (a compiled drafter's)."""
        if self._fixed is None:
            return
        with torch.inference_mode():  # as requests run: a graph compiled outside would not serve them
            top = max(ks)
            prompt = torch.zeros(top + 2, dtype=torch.long, device=self._fixed.keys.device)
            self.begin(prompt, prompt.numel() + 1)
            self.take_features(0, self._fixed_features.new_zeros(top + 2, self.head.config.hidden))
            for k in sorted(set(ks)):
                self._compiled_round(prompt.tolist(), top + 1, k)

    def rollback(self, valid_length: int) -> None:
        # Real pairs were fed only below the last committed token: they all stay. What the draft
        # steps wrote lies beyond and is overwritten by the next round's real pairs.
        self._have = min(self._have, valid_length)


class HeadBatch(HoldsNothing):
    """A feature head's drafting for the rows of a batch: a drafter of the head's for each row
    (`FeatureDrafter.for_row`), in the batch's row order, handed the target's features of the
    positions each row commits; a round's head steps run for every drafting row at once."""

    def __init__(self, drafter: FeatureDrafter, target: nn.Module) -> None:
        super().__init__(drafter)
        self.target = target
        self.rows: list[FeatureDrafter] | None = None  # None: it holds no row yet

    def _row(self, row: Row, fed: tuple[int, torch.Tensor] | None) -> FeatureDrafter:
        """A row's drafter, handed the features its prefill kept (`fed`), else those of one
        forward of the target over the row's context (the batch's cache holds keys and values,
        not features)."""
        drafter = self.drafter.for_row()
        drafter.begin(torch.tensor(row.tokens[:row.stopping.output_start]), row.prompt_len + row.max_new_tokens)
        if fed is None:
            context = torch.tensor([row.tokens[:-1]], device=self.target.device)
            out = self.target(input_ids=context, use_cache=False, output_hidden_states=True, logits_to_keep=1)
            fed = (0, out.hidden_states[-1][0])
        drafter.take_features(*fed)
        return drafter

    def catch_up(self, rows: list[Row]) -> bool:
        if self.rows is not None:
            return False
        self.rows = [self._row(r, None) for r in rows]
        return True

    def join(self, rows: list[Row], fed: list[tuple[int, torch.Tensor] | None], replace: bool) -> bool:
        joining = [self._row(r, f) for r, f in zip(rows, fed)]
        self.rows = joining if replace or self.rows is None else self.rows + joining
        return True

    def propose(self, rows: list[Row], ks: list[int]) -> Drafts:
        drafts = Drafts.none(len(rows))
        todo = [b for b, k in enumerate(ks) if k > 0]
        proposed = FeatureDrafter.propose_rows([self.rows[b] for b in todo], [rows[b].tokens for b in todo],
                                               [ks[b] for b in todo], [rows[b].sampling for b in todo],
                                               [rows[b].generator for b in todo])
        for b, (tokens, dist) in zip(todo, proposed):
            drafts.tokens[b], drafts.dists[b] = tokens, dist
        return drafts

    def accepted(self, b: int, row: Row, start: int, kept: int, drafts: Drafts, hidden: torch.Tensor | None) -> None:
        drafter = self.rows[b]
        if drafts.tokens[b]:
            drafter.rollback(start + kept)
        drafter.take_features(start - 1, hidden[: kept + 1])  # the verify fed the last token and the drafts

    def select(self, order: list[int]) -> None:
        if self.rows is not None:
            self.rows = [self.rows[b] for b in order]


def target_features(model, sequence: list[int], memo: dict) -> Features:
    """The target's features over the sequence (its last hidden states, what it hands a feature
    head while serving): those the request served handed over where `memo` holds them (under
    "features"), else from one forward over the sequence, kept in `memo`."""
    if "features" not in memo:
        with torch.inference_mode():
            out = model(torch.tensor([sequence], device=model.device), use_cache=False, output_hidden_states=True,
                        logits_to_keep=1)
        memo["features"] = Features(0, out.hidden_states[-1][0])
    return memo["features"]


def feature_chains(drafter: FeatureDrafter, inputs: ReplayInputs) -> list[list[float]] | None:
    """For each position from `inputs.start`: the acceptance probability of each of k drafts of
    a feature head's round from there (`FeatureDrafter.replay_logits`: greedy, exactly the
    head's rounds); None where the request edits its logits (the head's drafts then see edits
    along their own drafts, which this replay does not apply)."""
    sequence, start, k, target, sampling, memo = (inputs.sequence, inputs.start, inputs.k, inputs.target,
                                                  inputs.sampling, inputs.memo)
    if sampling is not None and sampling.adjusts_logits:
        return None
    if ("head", drafter, k) in memo:  # a hybrid drafting with the same head
        return memo["head", drafter, k]
    with torch.inference_mode():
        features = target_features(inputs.target_model, sequence, memo)
        if inputs.noise is not None:  # coupled: each draft the head's draw at its position
            probs = probabilities(drafter.replay_logits(features, sequence, start, k), sampling)  # [k, R, V]
            rounds = probs.shape[1]
            accept = [drawn_equal(inputs.noise, probs[j, :rounds - j], list(range(start + j, start + rounds)),
                                  sequence[start + j:]) for j in range(min(k, rounds))]
        elif target is None:  # [k, R]: draft j of the round from start + r drafts sequence[start + r + j]
            accept = drafter.replay_kept(features, sequence, start, k)
            rounds = accept.shape[1]
        else:
            logits = drafter.replay_logits(features, sequence, start, k)  # [k, R, V]
            rounds = logits.shape[1]
            offsets = torch.arange(rounds, device=logits.device)[None] + torch.arange(k, device=logits.device)[:, None]
            accept = torch.minimum(target[offsets.clamp(max=rounds - 1)], probabilities(logits, sampling)).sum(-1)
    accept = accept if isinstance(accept, list) else accept.tolist()
    memo["head", drafter, k] = [[accept[j][r] for j in range(min(k, rounds - r))] for r in range(rounds)]
    return memo["head", drafter, k]
