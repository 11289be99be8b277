"""Self-speculation by layer skip (engine/layer_skip.py): the target drafts for itself into its
own cache, and its output stays the target's on every path, whatever the skip set."""

import pytest
import torch
from conftest import tiny_llama, tiny_qwen3_next
from test_engine import hf_greedy, prompts
from test_sampling import ALPHA, PROMPT, VOCAB, exact_joint_of_tokens_2_and_3, p_value
from transformers import Qwen2Config, Qwen2ForCausalLM

from engine import (
    HybridDrafter,
    IncompatibleDrafterError,
    LayerSkipDrafter,
    RoundControl,
    SamplingParams,
    SpeculativeEngine,
)
from engine.layer_skip import parse_skip_name, skip_name


@pytest.fixture(scope="module")
def deep_target():
    return tiny_llama(3, layers=4)


def skip_drafters(skip_sets) -> dict:
    out = {skip_name(s): LayerSkipDrafter(s) for s in skip_sets}
    out["ngram+skip"] = HybridDrafter(LayerSkipDrafter(skip_sets[0]))
    return out


@pytest.mark.parametrize("cache", ["dynamic", *(pytest.param(c, marks=pytest.mark.slow)
                                                for c in ("static", "prefix-cached"))])
def test_greedy_equals_target_generate_for_every_skip_set_and_k(deep_target, cache):
    engine = SpeculativeEngine(deep_target, skip_drafters([{1}, {2, 3}, {1, 2, 3}]), static_cache=cache == "static",
                               prefix_cache_tokens=1024 if cache == "prefix-cached" else 0)
    accepted = 0
    for i, prompt in enumerate(prompts(6)):
        max_new = 17 + i % 5  # the last round's drafts cross max_new_tokens
        reference = hf_greedy(deep_target, prompt, max_new)
        for arm, probes in (("skip-1:1", 0), ("skip-1:3", 0), ("skip-2.3:8", 0), ("skip-1.2.3:2", 0),
                            ("ngram+skip:4", 0), ("off", 0), ("skip-1:3", 3), ("ngram+skip:4", 2)):
            # OFF rounds among the drafter's (`probe_off`) leave its cache behind the target's
            result = engine.generate(prompt, arm, max_new_tokens=max_new, control=RoundControl(probe_off=probes))
            assert result.tokens == reference, (i, arm, probes)
            assert not result.fell_back, result.fallback_error
            accepted += result.metrics.accepted
    assert accepted > 0


def test_the_drafter_is_the_target_itself_and_leaves_it_whole(deep_target):
    before = {name: p.data_ptr() for name, p in deep_target.named_parameters()}
    engine = SpeculativeEngine(deep_target, {"skip-2.3": LayerSkipDrafter({2, 3})})
    view = engine.drafters["skip-2.3"].runner.model
    assert len(view.model.layers) == 2 and len(deep_target.model.layers) == 4
    assert deep_target.config.num_hidden_layers == 4
    assert all(before[name] == p.data_ptr() for name, p in view.named_parameters())  # no weight of its own
    assert {name: p.data_ptr() for name, p in deep_target.named_parameters()} == before


def test_sliding_window_layers_keep_their_kind_in_the_view():
    """Qwen2 reads each layer's kind by its place: the view lists the kept layers' kinds."""
    torch.manual_seed(4)
    config = Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         use_sliding_window=True, sliding_window=6, max_window_layers=2,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    target = Qwen2ForCausalLM(config).eval()
    assert target.config.layer_types == ["full_attention"] * 2 + ["sliding_attention"] * 2
    with pytest.raises(IncompatibleDrafterError, match=r"cannot skip layer\(s\) \[2\]"):
        SpeculativeEngine(target, {"s": LayerSkipDrafter({2})})  # the first sliding layer sizes the sliding masks
    engine = SpeculativeEngine(target, {"s": LayerSkipDrafter({1}), "t": LayerSkipDrafter({1, 3})})
    for prompt in prompts(3, seed=5):
        reference = hf_greedy(target, prompt, 20)
        for arm in ("s:3", "t:2"):
            assert engine.generate(prompt, arm, max_new_tokens=20).tokens == reference, arm


@pytest.mark.parametrize(("arm", "params"), [
    ("skip:2", SamplingParams(1.0)),
    pytest.param("ngram+skip:2", SamplingParams(0.7, 0.9, repetition_penalty=1.5), marks=pytest.mark.slow),
])
def test_speculative_sampling_matches_the_target_distribution(arm, params):
    target = tiny_llama(12, layers=3, vocab=VOCAB, hidden=32)
    engine = SpeculativeEngine(target, {"skip": LayerSkipDrafter({2}),
                                        "ngram+skip": HybridDrafter(LayerSkipDrafter({1}))})
    assert engine.generate(PROMPT, arm, max_new_tokens=4, sampling=SamplingParams(1.0, seed=0)).metrics.drafted > 0
    assert p_value(engine, arm, params, exact_joint_of_tokens_2_and_3(target, params)) > ALPHA


@pytest.mark.parametrize(("skip", "message"), [
    (set(), "at least one layer"),
    ({0, 2}, r"cannot skip layer\(s\) \[0\]"),
    ({2, 4, 9}, r"cannot skip layers \[4, 9\]: LlamaForCausalLM has layers 0..3"),
])
def test_a_skip_set_the_target_cannot_take_is_refused_by_name(deep_target, skip, message):
    with pytest.raises(IncompatibleDrafterError, match=message):
        SpeculativeEngine(deep_target, {"skip": LayerSkipDrafter(skip)})


def test_a_target_with_recurrent_layers_is_refused():
    with pytest.raises(IncompatibleDrafterError, match="recurrent layers"):
        SpeculativeEngine(tiny_qwen3_next(0, layers=4), {"skip": LayerSkipDrafter({3})})


def test_a_draft_step_that_raises_leaves_the_request_to_off_with_the_cache_intact(deep_target, monkeypatch):
    engine = SpeculativeEngine(deep_target, {"skip": LayerSkipDrafter({2})})
    drafter = engine.drafters["skip"]
    calls = 0
    real = drafter.runner.step

    def fails_on_the_fifth_step(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == 5:  # midway through a round, after it wrote into the target's cache
            raise RuntimeError("out of memory")
        return real(*args, **kwargs)

    monkeypatch.setattr(drafter.runner, "step", fails_on_the_fifth_step)
    prompt = prompts(1, seed=7)[0]
    result = engine.generate(prompt, "skip:3", max_new_tokens=20)
    assert result.fell_back and "out of memory" in result.fallback_error
    assert result.tokens == hf_greedy(deep_target, prompt, 20)


def test_a_drafter_shared_by_two_engines_is_refused(deep_target):
    drafter = LayerSkipDrafter({1})
    SpeculativeEngine(deep_target, {"skip": drafter})
    with pytest.raises(IncompatibleDrafterError, match="another engine's target"):
        SpeculativeEngine(deep_target, {"skip": drafter})


def test_skip_names_round_trip():
    assert skip_name({5, 2, 3}) == "skip-2.3.5"
    assert parse_skip_name("skip-2.3.5") == frozenset({2, 3, 5})
    assert parse_skip_name("skip-") is None and parse_skip_name("skipper-1") is None
