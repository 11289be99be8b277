"""How one model runs: its KV cache and its decode step, eager or compiled.

- dynamic: a DynamicCache grown into preallocated buffers (kvcache.GrowingCache), cropped on
  rollback. The fastest eager path on CPU, where a StaticCache makes every step attend over its
  whole length.
- static: a StaticCache allocated per request; rollback just moves the write position back,
  and the next round overwrites the rejected entries (gpt-fast's trick; the causal mask hides
  them until then).
- compiled: one StaticCache per model, kept across requests at a fixed length, and the decode
  step compiled by torch.compile for fixed shapes: one graph per step length (1 token for OFF,
  K+1 for a verify, 1 or 2 for a drafter), compiled the first time a length is used and reused
  after. On CUDA the graphs are replayed as CUDA graphs (mode="reduce-overhead"). Prefill
  stays eager (prompt lengths vary). The first call of each length is timed and reported as
  that graph's compile cost. On CUDA every step attends over the whole cache, so it is kept
  short (512 positions unless asked otherwise); on CPU a step attends over the positions filled
  so far (see "step attention" below), so the cache spans the model's context (up to 4096
  positions). A request that does not fit runs on the dynamic eager path instead, still
  served, still lossless.

Three settings make the compiled step cheap on CPU, where a demo-target step is a few
milliseconds and fixed costs dominate:
- matmuls: inductor's own kernels instead of the BLAS library's (CPU_ONE_TOKEN, CPU_MANY_TOKENS);
- step attention: inside a compiled CPU step attention is written out as plain matmul,
  mask and softmax, which inductor fuses; the SDPA flash kernel for CPU is built for long
  queries and spent about half of a 1-token step. It reads the cache's first `span.shape[0]`
  positions only (those filled, rounded up to SPAN_ALIGN), `span` a tensor whose length the
  graph takes as a symbol (torch._dynamo.mark_dynamic): one graph serves every length, and a
  step no longer reads the cache's empty end (at 512 positions, a sixth of a demo-target step
  with 224 filled). Everywhere else (prefill, eager paths, generate() on the same model) the
  same function calls SDPA, so they are unchanged;
- guards: dynamo checks ~1,600 guards on module attributes before every call (about a
  tenth of a step); only the identity checks on parameters are kept, so two models (the
  target and a drafter run the same step code) never share a graph.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import time
import types
from pathlib import Path

import torch
from transformers import AttentionInterface, AttentionMaskInterface, PreTrainedModel, StaticCache
from transformers.cache_utils import LinearAttentionCacheLayerMixin
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from engine.kvcache import (
    GrowingCache,
    StateCheckpoint,
    crop_layers,
    recurrent_kinds,
    rollback_static_cache,
    uses_alibi,
)
from engine.prefix import PrefixCache

# Default length of a compiled model's cache, capped by its context: where every step attends
# over all of it (CUDA graphs, attention other than SDPA), short; where a step attends over the
# positions filled (CPU, SDPA: see "step attention" above), the model's context up to a bound.
COMPILED_CACHE_LEN = 512
SPANNED_CACHE_LEN = 4096
# A compiled CPU step's attention span is the positions filled rounded up to this (a vector's
# floats), and the cache is allocated this much longer than its requests may fill: a span as
# long as the whole cache would be a size dynamo specializes on (a slice that is the tensor).
SPAN_ALIGN = 16
# Enough compiled graphs for every step length a request can use (1..MAX_K + 1) per model.
RECOMPILE_LIMIT = 64


STEP_ATTENTION = "spec_autotune_step"


def step_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, scaling: float | None = None,
                   span: torch.Tensor | None = None, **kwargs):
    """SDPA, except inside a compiled CPU step, where written-out attention over the cache's
    first `span.shape[0]` positions (all with no `span`) lets inductor fuse it."""
    if not torch.compiler.is_compiling() or attention_mask is None or query.device.type != "cpu":
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    if span is not None:
        length = span.shape[0]
        key, value, attention_mask = key[:, :, :length], value[:, :, :length], attention_mask[..., :length]
    key = repeat_kv(key, module.num_key_value_groups)
    value = repeat_kv(value, module.num_key_value_groups)
    scores = torch.matmul(query, key.transpose(2, 3)) * (scaling or query.shape[-1] ** -0.5)
    scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
    weights = scores.softmax(dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), None


AttentionInterface.register(STEP_ATTENTION, step_attention)
AttentionMaskInterface.register(STEP_ATTENTION, sdpa_mask)


# Inductor settings for compiled CPU steps (see the module docstring). A 1-token step is a
# chain of matrix-vector products, which oneDNN/MKL run far below memory bandwidth on the CPU:
# inductor writes them as fused
# multiply-sums instead. A verify step of K+1 tokens is a thin GEMM, for which inductor's own
# C++ GEMM template (chosen by benchmarking it against ATen at compile time) costs about what one
# token costs. Freezing makes the weights constants of the graph, which both need.
CPU_ONE_TOKEN = {"freezing": True, "cpp.weight_prepack": False, "post_grad_fusion_options": {"decompose_mm_pass": {}}}
CPU_MANY_TOKENS = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN",
                   "autotune_num_choices_displayed": 0, "max_autotune_report_choices_stats": False}  # quiet


def keep_parameter_identity_guards(guards: list) -> list[bool]:
    """Drop dynamo's guards on module attributes except identity checks (see the module docstring)."""
    return [g.guard_type == "ID_MATCH" or not g.orig_guard.source.is_unspecialized_nn_module() for g in guards]


def compile_fixed(function, device: torch.device):
    """`function` compiled for fixed shapes, one graph per shape: replayed as CUDA graphs on a GPU;
    on CPU with dynamo's guards cut to parameter identities (see the module docstring)."""
    if device.type == "cuda":
        return torch.compile(function, mode="reduce-overhead", fullgraph=True, dynamic=False)
    return torch.compile(function, options={"guard_filter_fn": keep_parameter_identity_guards}, fullgraph=True,
                         dynamic=False)


def first_call_timed(compile_s: dict[str, float], name: str, settings, call):
    """`call()`; the first time for `name`, under `settings` (inductor's, read as its graph
    compiles), with its seconds recorded in `compile_s[name]` as that graph's compile cost."""
    if name in compile_s:
        return call()
    began = time.perf_counter()
    with settings:
        result = call()
    compile_s[name] = time.perf_counter() - began
    return result


def use_compile_cache_dir() -> None:
    """Keep inductor's compiled kernels in the user cache between processes, unless set already."""
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "spec-autotune" / "inductor"
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(default))


def cache_argument(model) -> str:
    """The name under which `model.forward` takes its cache: `cache` in transformers 5.24 (where
    `past_key_values` still works but is deprecated, to go in 5.40), `cache_params` for Mamba-style
    models in 5.23 (where a `past_key_values` would be dropped into **kwargs and every step start
    from a fresh cache), `past_key_values` before."""
    forward = inspect.signature(type(model).forward).parameters  # the class's: an instance's may be wrapped
    return next((name for name in ("cache", "past_key_values", "cache_params") if name in forward),
                "past_key_values")


class ModelRunner:
    """Prefill, step and rollback for one model, hiding which cache and which forward it uses."""

    def __init__(self, model: PreTrainedModel, cache: str = "dynamic", max_cache_len: int | None = None) -> None:
        if cache not in ("dynamic", "static", "compiled"):
            raise ValueError(f"cache must be 'dynamic', 'static' or 'compiled', got {cache!r}")
        self.model = model
        self.kind = cache
        self.compile_s: dict[str, float] = {}  # "T->keep" -> seconds its first (compiling) call took
        self._cache: GrowingCache | StaticCache | None = None
        # Linear-attention layers (hybrid models) roll back from a checkpoint (kvcache.StateCheckpoint):
        # the one taken before the first step since the last truncate, and the tokens fed since.
        self.recurrent = bool(recurrent_kinds(model.config))
        if self.recurrent and cache != "dynamic":
            raise ValueError(f"{type(model).__name__} has {', '.join(sorted(recurrent_kinds(model.config)))} layers,"
                             f" which a {cache} cache cannot roll back: use the dynamic cache")
        if uses_alibi(model.config) and cache != "dynamic":
            raise ValueError(f"{type(model).__name__} biases attention by ALiBi, which a {cache} cache's length"
                             " throws off: use the dynamic cache")
        self._checkpoint: StateCheckpoint | None = None
        self._fed: list[torch.Tensor] = []
        self.prefixes: PrefixCache | None = None  # earlier prompts' keys and values (engine/prefix.py)
        self.reused = 0  # prompt positions the last `begin` took from `prefixes`
        self._cache_arg = cache_argument(model)
        self.verifies = True  # a step of several tokens continues from the cache (see `_check_steps`)
        # Keep the last hidden states (what the LM head reads) of every forward's positions in
        # `hidden` [T, H], for a drafter that drafts from them (engine/feature.py).
        self.keeps_hidden = False
        self.hidden: torch.Tensor | None = None
        if self.recurrent:
            self._check_steps()
        self._eager_request = cache != "compiled"  # a compiled runner serves too-long requests eagerly
        if cache == "compiled":
            # Allocated by the first `begin`: a runner that steps into another's cache (use_cache_of) needs none.
            self._static: StaticCache | None = None
            use_compile_cache_dir()
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
            self._spans = False  # whether steps attend over the filled positions only (`_span`)
            if model.device.type == "cuda":  # CUDA graphs
                self._one_token = self._many_tokens = contextlib.nullcontext()
            else:
                if model.config._attn_implementation == "sdpa":
                    model.set_attn_implementation(STEP_ATTENTION)
                self._spans = model.config._attn_implementation == STEP_ATTENTION
                # Inductor reads these from its global config when a graph compiles, which happens
                # inside a call (torch.compile's options do not reach them): patched around the
                # first call of each step length.
                self._one_token = torch._inductor.config.patch(CPU_ONE_TOKEN)
                self._many_tokens = torch._inductor.config.patch(CPU_MANY_TOKENS)
            default = SPANNED_CACHE_LEN if self._spans else COMPILED_CACHE_LEN
            context = getattr(model.config, "max_position_embeddings", None) or default
            self.max_cache_len = min(max_cache_len or default, context)
            self._compiled = compile_fixed(self._own(ModelRunner._eager_step), model.device)
            # A drafter's greedy round, one graph per (tokens fed first, K): see `greedy_drafts`.
            self._drafts = compile_fixed(self._own(ModelRunner._greedy_drafts), model.device)

    def begin(self, prompt: torch.Tensor, max_length: int, logits_to_keep: int = 1) -> torch.Tensor:
        """Prefill `prompt` (eager) into a fresh cache that will hold at most `max_length` positions."""
        if self.kind == "compiled" and max_length <= self.max_cache_len:
            self._eager_request = False
            if self._static is None:
                self._static = rollback_static_cache(self.model.config, self.max_cache_len + SPAN_ALIGN)
            self._cache = self._static
            self.truncate(0)
        elif self.kind == "static":
            self._cache = rollback_static_cache(self.model.config, max_length)
        else:
            self._eager_request = True
            self._cache = GrowingCache(self.model.config)
            self._checkpoint, self._fed = None, []
        # Kept prefixes serve prompts not scored (scoring needs every position's logits), written into
        # a fresh cache of any kind (a static layer writes from its write position, 0 here, as a
        # growing one appends); not models with recurrent layers, whose states no prefix gives.
        keeps = self.prefixes is not None and not self.recurrent
        tokens = prompt.tolist() if keeps else None
        self.reused, kept = self.prefixes.lookup(tokens) if keeps and logits_to_keep else (0, None)
        if kept is None:
            out = self.model(prompt[None], **{self._cache_arg: self._cache}, use_cache=True,
                             logits_to_keep=logits_to_keep, output_hidden_states=self.keeps_hidden)
        else:
            for layer, (keys, values) in zip(self._cache.layers, kept, strict=True):
                layer.update(keys, values)
            positions = torch.arange(self.reused, prompt.numel(), device=prompt.device)
            out = self.model(prompt[None, self.reused:], **{self._cache_arg: self._cache}, use_cache=True,
                             logits_to_keep=logits_to_keep, cache_position=positions, position_ids=positions[None],
                             output_hidden_states=self.keeps_hidden)
        self.hidden = out.hidden_states[-1][0] if self.keeps_hidden else None
        if keeps:
            self.keep(tokens)
        return out.logits[0]

    def keep(self, tokens: list[int]) -> None:
        """Keep the cache's first len(tokens) positions, `tokens`' keys and values, for later
        prompts that start with them (engine/prefix.py): a prompt as it is prefilled, a prompt
        and its output when the request is done (a chat's next turn starts with both)."""
        if self.prefixes is not None and not self.recurrent and self._cache is not None:
            self.prefixes.insert(tokens, lambda: self.cached(len(tokens)))

    @torch.inference_mode()
    def _check_steps(self) -> None:
        """Make sure this recurrent model's cached steps continue from its states.

        Transformers' recurrent layers differ: some read their state in a step of any length
        (Qwen3-Next, Bamba), others only in a one-token step and restart it in a longer one
        (Mamba, Jamba), which generate()'s one-token decoding never notices but a verify of K+1
        tokens would, silently. So each kind of state (convolution, recurrent) is disturbed in
        turn after a prefill: a step that gives the same logits anyway does not read it. A
        one-token step must read every kind, or the model cannot be served here at all; a
        several-token step must too, and a rollback must run, or the model can neither verify
        drafts nor draft (`verifies`). Disturbing the state, unlike comparing with a full forward,
        does not depend on how much a model's weights let its state matter.
        """
        vocab = self.model.config.get_text_config(decoder=True).vocab_size
        ids = torch.arange(3, 11, device=self.model.device) % vocab
        name = type(self.model).__name__
        try:
            self.begin(ids[:4], 16)
            layers = [layer for layer in self._cache.layers if isinstance(layer, LinearAttentionCacheLayerMixin)]
            kinds = [kind for kind in ("conv_states", "recurrent_states")
                     if any(s is not None for layer in layers for s in getattr(layer, kind).values())]
            if not kinds:
                raise ValueError(f"{name} keeps no state in the cache this engine gives it: it cannot be served here")
            prefilled = StateCheckpoint(self._cache, 4)

            def step(tokens: torch.Tensor, disturb: str | None = None) -> torch.Tensor:
                prefilled.restore()
                for layer in layers if disturb else ():
                    for state in getattr(layer, disturb).values():
                        if state is not None:
                            state.add_(1.0)
                positions = torch.arange(4, 4 + len(tokens), device=tokens.device)
                return self._eager_step(tokens[None], positions, len(tokens))[0]

            def reads_every_kind(tokens: torch.Tensor) -> bool:
                as_is = step(tokens)
                return all(not torch.equal(step(tokens, kind), as_is) for kind in kinds)

            if not reads_every_kind(ids[4:5]):
                raise ValueError(f"{name}'s one-token steps do not read its cached states: it cannot be served here")
            self.verifies = reads_every_kind(ids[4:7])
            if self.verifies:
                try:
                    self.begin(ids[:4], 16)
                    self.step(ids[None, 4:7], 4, keep=3)
                    self.truncate(5)
                    self.step(ids[None, 5:7], 5, keep=2)
                except Exception:  # a layer that cannot be rolled back
                    self.verifies = False
        finally:
            self._cache, self._checkpoint, self._fed = None, None, []

    def step(self, tokens: torch.Tensor, start: int, keep: int) -> torch.Tensor:
        """Logits [keep, V] for the last `keep` of `tokens` [1, T], fed at positions start..start+T-1
        (and in `hidden` their hidden states [T, H], if `keeps_hidden`)."""
        # Explicit positions, as generate() passes them; a tensor, so compiled graphs do not
        # specialize on the position.
        positions = torch.arange(start, start + tokens.shape[1], device=tokens.device)
        if self.recurrent:
            if self._checkpoint is None:
                self._checkpoint = StateCheckpoint(self._cache, start)
            self._fed.append(tokens)
        if self._eager_request:
            logits, self.hidden = self._eager_step(tokens, positions, keep)
            return logits
        # tokens in -> logits out: one graph each, compiled by its first call under that length's settings
        span = self._span(start + tokens.shape[1])
        logits, hidden = first_call_timed(self.compile_s, f"{tokens.shape[1]}->{keep}",
                                          self._one_token if tokens.shape[1] == 1 else self._many_tokens,
                                          lambda: self._compiled(tokens, positions, keep, span))
        if tokens.device.type == "cuda":  # a CUDA graph overwrites its output buffers on the next replay
            logits, hidden = logits.clone(), None if hidden is None else hidden.clone()
        self.hidden = hidden
        return logits

    def greedy_drafts(self, tokens: torch.Tensor, start: int, k: int) -> torch.Tensor:
        """A drafter's greedy round: feed `tokens` [1, T] at positions start.., then K greedy
        drafts [K], each fed in turn but the last, as K calls of `step` would. On a compiled
        runner the round is one graph per (T, K): a drafter step is too small for K calls
        through dynamo to cost less than their arithmetic (a round's host overhead)."""
        positions = torch.arange(start, start + tokens.shape[1], device=tokens.device)
        if self._eager_request:
            return self._greedy_drafts(tokens, positions, k)
        span = self._span(start + tokens.shape[1] + k - 1)  # the last draft is not fed
        drafts = first_call_timed(self.compile_s, f"{tokens.shape[1]}->{k} drafts", self._one_token,
                                  lambda: self._drafts(tokens, positions, k, span))
        return drafts.clone() if tokens.device.type == "cuda" else drafts

    def _greedy_drafts(self, tokens: torch.Tensor, positions: torch.Tensor, k: int,
                       span: torch.Tensor | None = None) -> torch.Tensor:
        logits, _ = self._eager_step(tokens, positions, 1, span)
        drafts = []
        for step in range(k):
            token = logits[-1].argmax(-1)
            drafts.append(token)
            if step + 1 < k:
                logits, _ = self._eager_step(token.view(1, 1), positions[-1:] + 1 + step, 1, span)
        return torch.stack(drafts)

    def _span(self, filled: int) -> torch.Tensor | None:
        """What a compiled CPU step's attention reads (see the module docstring): a tensor as long
        as the cache positions filled once the step is done, rounded up to SPAN_ALIGN; None on CUDA."""
        if not self._spans:
            return None
        cache_len = self._cache.layers[0].max_cache_len
        span = torch.empty(min(-(-filled // SPAN_ALIGN) * SPAN_ALIGN, cache_len - 1), dtype=torch.int8)
        torch._dynamo.mark_dynamic(span, 0, min=2, max=cache_len - 1)
        return span

    def use_cache_of(self, other: ModelRunner) -> None:
        """Step into `other`'s cache, as it stands for `other`'s current request: for a view of
        `other`'s model with layers skipped (engine/layer_skip.py), which drafts into the target's
        cache; `other.truncate` then cuts back what it wrote."""
        self._cache, self._eager_request = other._cache, other._eager_request

    def _own(self, function):
        """This runner's `function` (`_eager_step`, `_greedy_drafts`) with a code object of its own:
        dynamo keeps its graphs per code object and tests a call against each graph's guards in
        turn, so with one shared code object a drafter's step would first be tested against every
        target graph (+57 us on a 250 us drafter step)."""
        code = function.__code__.replace()  # an equal but distinct code object
        return types.MethodType(types.FunctionType(code, function.__globals__), self)

    def _eager_step(self, tokens: torch.Tensor, positions: torch.Tensor, keep: int,
                    span: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [keep, V], and the hidden states [T, H] if `keeps_hidden`; `span`: a compiled
        CPU step's (see `_span`)."""
        spans = {} if span is None else {"span": span}
        out = self.model(tokens, **{self._cache_arg: self._cache}, use_cache=True, logits_to_keep=keep,
                         cache_position=positions, position_ids=positions[None], output_hidden_states=self.keeps_hidden,
                         **spans)
        return out.logits[0], (out.hidden_states[-1][0] if self.keeps_hidden else None)

    def cached(self, length: int) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """A copy of each layer's keys and values [1, heads, length, width] for the first `length`
        positions, so a paused request joins a batch without a second prefill; None for a model
        with recurrent layers (batches do not take them)."""
        if self.recurrent or self._cache is None:
            return None
        return [(layer.keys[..., :length, :].clone(), layer.values[..., :length, :].clone())
                for layer in self._cache.layers]

    def truncate(self, length: int) -> None:
        """Forget cached positions beyond `length` (rejected drafts); the prefix is never recomputed
        (but for linear-attention layers, see `_roll_back_states`)."""
        if self.recurrent:
            self._roll_back_states(length)
            return
        if isinstance(self._cache, StaticCache):
            for layer in self._cache.layers:
                if layer.is_initialized:
                    layer.cumulative_length.fill_(length)
            return
        crop_layers(self._cache, length)

    def _roll_back_states(self, length: int) -> None:
        """Back to the checkpoint, then feed again the tokens fed since that stay: a recurrent
        state cannot forget the rejected ones."""
        checkpoint, fed = self._checkpoint, self._fed
        self._checkpoint, self._fed = None, []
        if checkpoint is None or length >= checkpoint.length + sum(t.shape[1] for t in fed):
            return  # nothing to forget: the next step checkpoints the states as they are
        if length < checkpoint.length:
            raise ValueError(f"cannot roll back to {length}: the states were checkpointed at {checkpoint.length}")
        checkpoint.restore()
        fed = torch.cat(fed, dim=1)
        if length > checkpoint.length:
            self._eager_step(fed[:, : length - checkpoint.length],
                             torch.arange(checkpoint.length, length, device=fed.device), keep=1)
