"""Self-speculation: the target drafts for itself with some of its decoder layers skipped.

SWIFT (Xia et al., 2024) skips a set of intermediate layers found per task; LayerSkip's early
exit (Elhoushi et al., 2024; transformers' `assistant_early_exit`) is the set of the last
layers. Either way the drafter is a view of the target: the same modules, the kept layers
only, no weight of its own. It has no cache of its own either: it drafts into the target's,
which already holds every committed position as the full model computed it (what SWIFT and
Draft & Verify do), so the drafter needs no prefill and never catches up. Between rounds the
target's cache holds every position but the last token's (engine/engine.py); a round's K draft
steps write the kept layers' entries from there on, and the drafter cuts the cache back to
where it found it before the target verifies, whose step overwrites those positions in every
layer. Greedy output is the target's whatever the skip set: only acceptance depends on it.

A skip set never holds a layer that transformers reads the cache's length from to size the
masks (the first layer of each attention kind): in a dynamic cache a skipped layer does not grow.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import torch
from torch import nn

from engine.drafters import Capabilities
from engine.errors import IncompatibleDrafterError
from engine.kvcache import recurrent_kinds
from engine.runner import ModelRunner
from engine.sampling import draft_token

LAYER_LISTS = ("layers", "h", "blocks")  # where a decoder keeps its layers (Llama and most; GPT-2; others)


def skip_name(skip: Iterable[int]) -> str:
    """The drafter name the default engine gives a skip set: `skip-2.3.5`."""
    return "skip-" + ".".join(str(i) for i in sorted(skip))


def parse_skip_name(name: str) -> frozenset[int] | None:
    """The skip set `name` stands for (`skip-2.3.5`), or None if it names none."""
    prefix, _, rest = name.partition("-")
    parts = rest.split(".")
    if prefix != "skip" or not rest or not all(p.isdigit() for p in parts):
        return None
    return frozenset(int(p) for p in parts)


def decoder_layers(model: nn.Module) -> tuple[nn.Module, str, nn.ModuleList]:
    """The module holding `model`'s decoder layers, the attribute they are under, and the layers."""
    base = getattr(model, model.base_model_prefix, model)
    count = model.config.get_text_config(decoder=True).num_hidden_layers
    for attribute in LAYER_LISTS:
        layers = getattr(base, attribute, None)
        if isinstance(layers, nn.ModuleList) and len(layers) == count:
            return base, attribute, layers
    raise IncompatibleDrafterError(f"cannot find {type(model).__name__}'s {count} decoder layers"
                                   f" (looked for a ModuleList named {', '.join(LAYER_LISTS)})")


def reference_layers(config) -> set[int]:
    """Layers the masks' sizes are read from: the first of each attention kind."""
    kinds = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    return {kinds.index(kind) for kind in set(kinds)}


def check_skip_set(model: nn.Module, skip: Iterable[int]) -> frozenset[int]:
    """`skip` as a frozenset, or an error naming what is wrong with it for `model`."""
    skip = frozenset(skip)
    config = model.config.get_text_config(decoder=True)
    count = config.num_hidden_layers
    if not skip:
        raise IncompatibleDrafterError("a skip set names at least one layer to skip (none is the target itself)")
    outside = sorted(i for i in skip if not 0 <= i < count)
    if outside:
        raise IncompatibleDrafterError(f"cannot skip layers {outside}:"
                                       f" {type(model).__name__} has layers 0..{count - 1}")
    held = sorted(skip & reference_layers(config))
    if held:
        raise IncompatibleDrafterError(f"cannot skip layer(s) {held}: the masks read the cache's length from them"
                                       " (the first layer of each attention kind)")
    if recurrent_kinds(config):
        raise IncompatibleDrafterError(f"{type(model).__name__} has recurrent layers, whose states a draft"
                                       " cannot write and take back: layer skip drafts attention models only")
    return skip


def skipping_view(model: nn.Module, skip: frozenset[int]) -> nn.Module:
    """`model` without the layers in `skip`: new containers over the same modules (no weight
    copied, nothing of `model` changed), and a config that lists the kept layers' kinds, since
    some decoders read a layer's kind by its place (Qwen2, Gemma2)."""
    base, attribute, layers = decoder_layers(model)
    kept = [i for i in range(len(layers)) if i not in skip]
    config = copy.copy(base.config)
    config.num_hidden_layers = len(kept)
    if getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[i] for i in kept]
    view_base = copy.copy(base)
    view_base._modules = dict(base._modules)  # copy.copy shares the dict: setting a child would change `base`
    view_base.config = config
    setattr(view_base, attribute, nn.ModuleList([layers[i] for i in kept]))
    if base is model:
        return view_base
    view = copy.copy(model)
    view._modules = dict(model._modules)
    setattr(view, model.base_model_prefix, view_base)
    return view


class LayerSkipDrafter:
    """Drafts with the target itself, the layers in `skip` left out (see the module docstring).

    Declares `Capabilities(shares_target=True)`: the engine hands it the target's runner
    (`share`), into whose cache it drafts through a runner of its own for the view, of the same
    kind (on a compiled engine a greedy round is one graph per K, as a model drafter's). Not
    batched and not replayed: the controller learns its arms by serving them.
    """

    capabilities = Capabilities(shares_target=True)
    model_drafter = None
    lookup = None
    max_length = None  # the target's own

    def __init__(self, skip: Iterable[int]) -> None:
        self.skip = frozenset(skip)
        self.target: ModelRunner | None = None
        self.runner: ModelRunner | None = None  # the view's
        self.vocab_size: int | None = None
        self.one_graph = True  # False: draft step by step on a compiled engine too

    @property
    def name(self) -> str:
        return skip_name(self.skip)

    @property
    def compile_s(self) -> dict[str, float]:
        return self.runner.compile_s if self.runner is not None else {}

    def share(self, target: ModelRunner) -> None:
        """Draft with `target`'s model and into its cache; refuses a skip set the model cannot take."""
        if self.target is not None and self.target is not target:
            raise IncompatibleDrafterError(f"{self.name} already drafts for another engine's target;"
                                           " give each engine its own LayerSkipDrafter")
        self.skip = check_skip_set(target.model, self.skip)
        view = skipping_view(target.model, self.skip)
        self.runner = ModelRunner(view, target.kind, getattr(target, "max_cache_len", None))
        self.target = target
        self.vocab_size = target.model.config.get_text_config(decoder=True).vocab_size

    def warm_up(self, ks: list[int]) -> None:
        """Compile the view's 1-token step and its greedy rounds of each K (a compiled engine)."""
        prompt = torch.zeros(4, dtype=torch.long, device=self.target.model.device)
        last = torch.zeros(1, 1, dtype=torch.long, device=prompt.device)  # contiguous, as served: strides are guarded
        self.target.begin(prompt, prompt.numel() + 1 + max(ks))
        self.runner.use_cache_of(self.target)
        self.runner.step(last, prompt.numel(), keep=1)
        for k in ks:
            self.runner.greedy_drafts(last, prompt.numel(), k)
        self.target.truncate(prompt.numel())

    def begin(self, prompt: torch.Tensor, max_length: int) -> None:
        if self.target is None:
            raise IncompatibleDrafterError(f"{self.name} drafts for no target: add it to an engine first")
        self._output_start = prompt.numel()

    def propose(self, tokens, k, params, generator):
        start = len(tokens) - 1  # the target's cache holds every position before the last token
        step = torch.tensor([tokens[-1:]], device=self.target.model.device)
        self.runner.use_cache_of(self.target)
        try:
            if self.runner.kind == "compiled" and self.one_graph and params.greedy and not params.adjusts_logits:
                return self.runner.greedy_drafts(step, start, k).tolist(), None
            draft: list[int] = []
            dists = []
            for i in range(k):
                logits = self.runner.step(step, start + i, keep=1)[-1]
                token, q = draft_token(logits, tokens + draft, self._output_start, params, generator)
                draft.append(token)
                dists += [] if q is None else [q]
                step = torch.tensor([[token]], device=step.device)
            return draft, (torch.stack(dists) if dists else None)
        finally:  # the target's cache as it was, even if a step failed: the request goes on OFF
            self.target.truncate(start)

    def rollback(self, valid_length: int) -> None:
        pass  # nothing of its own to forget: the target's verify rolled its cache back
