"""The engine on other architectures than the Llama the rest of the suite uses: learned
absolute positions (GPT-2), an offset position table (OPT), partial rotary (GPT-NeoX), latent
attention whose cached keys and values differ in width (DeepSeek-V2 and V3), sliding-window
attention (Mistral and Starcoder2, every layer; Qwen2, Gemma2 and GPT-OSS, mixed with full
layers, Gemma2 with logit softcapping, GPT-OSS with attention sinks), layers without rotary
positions (SmolLM3), chunked attention mixed with full (Llama 4), recurrent layers mixed with
full attention (Qwen3-Next's linear attention, Falcon-H1's, Zamba2's and Nemotron-H's Mamba-2
mixers, LFM2's short convolutions; one request at a time), models whose recurrent layers cannot
verify drafts (Mamba: OFF only), and ALiBi (MPT, Falcon: alone, on the dynamic cache).

transformers' own sliding-window cache keeps only the last window, which a speculative decoder
cannot roll back past; the engine keeps the history and applies the window (or chunk) in the
masks. Every output must still be the target's own greedy output once requests are longer
than the window.
"""

import pytest
import torch
import transformers
from conftest import tiny_llama, tiny_qwen3_next
from test_engine import hf_greedy

from engine import (
    BatchRequest,
    HybridDrafter,
    IncompatibleDrafterError,
    InvalidRequestError,
    NGramDrafter,
    SpeculativeEngine,
)

WINDOW = 8
COMMON = dict(vocab_size=64, bos_token_id=None, eos_token_id=None, pad_token_id=None)
SHAPE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256, initializer_range=0.3, **COMMON)
PROMPTS = [list(range(3, 30)), list(range(10, 20)), [5, 6, 7] * 6]
NEW = 40


def mistral(layers: int, window: int | None = WINDOW):
    return transformers.MistralConfig(num_hidden_layers=layers, sliding_window=window, **SHAPE)


def mixed(kind, layers: list[str], **extra):
    return kind(num_hidden_layers=len(layers), sliding_window=WINDOW, layer_types=layers, **extra, **SHAPE)


CONFIGS = {  # name: (target config, drafter config)
    "mistral": lambda: (mistral(2), mistral(1)),
    "starcoder2": lambda: (transformers.Starcoder2Config(num_hidden_layers=2, sliding_window=WINDOW, **SHAPE),
                           transformers.Starcoder2Config(num_hidden_layers=1, sliding_window=WINDOW, **SHAPE)),
    "qwen2-mixed": lambda: (mixed(transformers.Qwen2Config, ["sliding_attention", "full_attention"],
                                  use_sliding_window=True),
                            mixed(transformers.Qwen2Config, ["sliding_attention"], use_sliding_window=True)),
    "gemma2-mixed": lambda: (mixed(transformers.Gemma2Config, ["sliding_attention", "full_attention"], head_dim=16),
                             mixed(transformers.Gemma2Config, ["full_attention"], head_dim=16)),
    "llama4-chunked": lambda: tuple(  # 4 layers: 3 chunked, 1 full
        transformers.Llama4TextConfig(num_hidden_layers=n, head_dim=16, attention_chunk_size=WINDOW,
                                      num_local_experts=2, intermediate_size_mlp=128, **SHAPE) for n in (4, 1)),
    "deepseek_v2": lambda: tuple(  # latent attention: its cached keys and values differ in width
        transformers.DeepseekV2Config(num_hidden_layers=n, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
                                      qk_nope_head_dim=8, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
                                      first_k_dense_replace=1, moe_intermediate_size=32, n_group=1, topk_group=1,
                                      **dict(SHAPE, num_key_value_heads=4)) for n in (2, 1)),
    "deepseek_v3": lambda: tuple(  # latent attention, sigmoid-routed experts
        transformers.DeepseekV3Config(num_hidden_layers=n, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
                                      qk_nope_head_dim=8, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
                                      first_k_dense_replace=1, moe_intermediate_size=32, n_group=1, topk_group=1,
                                      **dict(SHAPE, num_key_value_heads=4)) for n in (2, 1)),
    "gpt_oss-sinks": lambda: tuple(  # attention sinks, sliding layers mixed with full
        transformers.GptOssConfig(num_hidden_layers=n, head_dim=16, sliding_window=WINDOW, num_local_experts=4,
                                  num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"][:n],
                                  **SHAPE) for n in (2, 1)),
    "smollm3-nope": lambda: tuple(  # every other layer without rotary positions
        transformers.SmolLM3Config(num_hidden_layers=n, no_rope_layer_interval=2, **SHAPE) for n in (2, 1)),
    "gpt2": lambda: tuple(transformers.GPT2Config(n_embd=64, n_layer=n, n_head=4, n_positions=256,
                                                  initializer_range=0.3, **COMMON) for n in (2, 1)),
    "opt": lambda: tuple(transformers.OPTConfig(hidden_size=64, num_hidden_layers=n, num_attention_heads=4,
                                                ffn_dim=128, max_position_embeddings=256, word_embed_proj_dim=64,
                                                init_std=0.3, **COMMON) for n in (2, 1)),
    "gpt_neox": lambda: tuple(transformers.GPTNeoXConfig(hidden_size=64, num_hidden_layers=n, num_attention_heads=4,
                                                         intermediate_size=128, max_position_embeddings=256,
                                                         initializer_range=0.3, **COMMON) for n in (2, 1)),
}


def build(config, seed: int):
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


@pytest.fixture(scope="module", params=list(CONFIGS))
def models(request):
    target_config, drafter_config = CONFIGS[request.param]()
    target = build(target_config, 0)
    return target, build(drafter_config, 1), [hf_greedy(target, p, NEW) for p in PROMPTS]


def test_the_window_shapes_these_outputs():
    """Without it the same weights decode otherwise: the tests below would catch a lost window."""
    windowed, full = build(mistral(2), 0), build(mistral(2, None), 0)
    assert [hf_greedy(windowed, p, NEW) for p in PROMPTS] != [hf_greedy(full, p, NEW) for p in PROMPTS]


@pytest.mark.parametrize("static_cache", [False, True])
def test_one_request_at_a_time_is_lossless(models, static_cache):
    target, drafter, expected = models
    engine = SpeculativeEngine(target, {"small": drafter, "ngram": NGramDrafter()}, static_cache=static_cache)
    for arm in ("off", "small:3", "ngram:4"):
        results = [engine.generate(p, arm, max_new_tokens=NEW) for p in PROMPTS]
        assert [r.tokens for r in results] == expected, arm
        assert not any(r.fell_back for r in results), arm  # speculation served them, not the fallback


@pytest.mark.parametrize("compacted", [False, True], ids=["as it runs", "compacted every round"])
def test_a_batch_and_a_request_joining_it_are_lossless(models, compacted, monkeypatch):
    """Also with both caches dropping their holes before every round (BatchCache.compact):
    windows, chunks and sinks are masked from each slot's position, wherever it moved to."""
    if compacted:
        monkeypatch.setattr("engine.batch.COMPACT_SLACK", -(1 << 30))
    target, drafter, expected = models
    engine = SpeculativeEngine(target, {"small": drafter, "ngram": NGramDrafter()})
    for arm in ("off", "small:3", "ngram:4"):
        calls = []

        def admit(live_rows, calls=calls):
            calls.append(live_rows)
            return [BatchRequest(PROMPTS[2], NEW)] if len(calls) == 5 else []  # joins after 4 rounds

        batch = engine.generate_batch(PROMPTS[:2], arm, max_new_tokens=NEW, admit=admit)
        assert calls[4] == 2  # it joined two rows still decoding
        assert [r.tokens for r in batch] == expected, arm
        assert not any(r.fell_back for r in batch), arm


@pytest.mark.parametrize("static_cache", [False, True])
def test_prompts_starting_as_kept_ones_prefill_the_rest_only_and_stay_lossless(models, static_cache):
    """Kept prefixes (engine/prefix.py), alone (growing or static cache) and in a batch: the rest
    of a prompt is fed at its own positions after the kept ones, windows, chunks and sinks masked
    from those positions."""
    target, drafter, expected = models
    extra = PROMPTS[0][:20] + list(range(40, 48))  # starts as PROMPTS[0], 8 more past the window
    engine = SpeculativeEngine(target, {"small": drafter}, prefix_cache_tokens=256, static_cache=static_cache)
    engine.generate(PROMPTS[0], "off", 1)
    first = engine.generate(extra, "off", NEW)
    assert first.metrics.cached_prompt_tokens == 20 and first.tokens == hf_greedy(target, extra, NEW)
    batch = engine.generate_batch([extra, PROMPTS[0], PROMPTS[1]], "small:3", NEW)
    assert [r.metrics.cached_prompt_tokens for r in batch] == [len(extra) - 1, len(PROMPTS[0]) - 1, 0]
    assert [r.tokens for r in batch] == [first.tokens, *expected[:2]]
    again = engine.generate(extra[:24] + [9], "small:3", NEW)  # the drafter kept the batch's prompts
    assert engine.drafters["small"].runner.reused == 24
    assert again.tokens == hf_greedy(target, extra[:24] + [9], NEW)


RECURRENT = {  # models whose layers hold a recurrent state: name -> (seed -> model)
    # gated linear attention between full-attention layers
    "qwen3next": tiny_qwen3_next,
    # a Mamba-2 mixer and attention side by side in every layer: one cache layer holds both
    "falcon_h1": lambda seed: build(transformers.FalconH1Config(
        num_hidden_layers=2, head_dim=16, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8,
        mamba_chunk_size=8, **SHAPE), seed),
    # Mamba-2 layers and a shared attention block (Zamba2), Mamba-2 and attention layers (Nemotron-H)
    "zamba2": lambda seed: build(transformers.Zamba2Config(
        num_hidden_layers=2, hidden_size=64, mamba_d_state=8, mamba_headdim=16, n_mamba_heads=8, num_attention_heads=4,
        num_key_value_heads=4, attention_head_dim=16, intermediate_size=128, layers_block_type=["mamba", "hybrid"],
        max_position_embeddings=256, initializer_range=0.3, **COMMON), seed),
    "nemotron_h": lambda seed: build(transformers.NemotronHConfig(
        num_hidden_layers=2, hybrid_override_pattern="M*", mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=8,
        n_groups=1, chunk_size=8, head_dim=16, **SHAPE), seed),
    # short convolutions (a convolution state, no recurrent one) between full-attention layers
    "lfm2": lambda seed: build(transformers.Lfm2Config(num_hidden_layers=2, layer_types=["conv", "full_attention"],
                                                       **SHAPE), seed),
}


@pytest.fixture(scope="module", params=[name if name == "lfm2" else pytest.param(name, marks=pytest.mark.slow)
                                        for name in RECURRENT])
def recurrent(request):
    """A model with recurrent layers as target, a drafter of its kind, and the target's greedy outputs."""
    target, drafter = RECURRENT[request.param](0), RECURRENT[request.param](1)
    return target, drafter, [hf_greedy(target, p, NEW) for p in PROMPTS]


def test_a_recurrent_model_rolls_its_states_back_and_stays_lossless(recurrent):
    """A linear-attention, Mamba or convolution layer holds one state, not an entry per position,
    so no crop can take rejected drafts back out of it (transformers' crop refuses, and the
    request failed): the engine restores the states from before the round and feeds the kept
    tokens again. Drafters: a Llama, a model of the target's kind (rolled back the same way),
    n-gram lookup, and lookup with that model elsewhere (its catch-up steps feed several tokens).
    Kept prefixes give no states: such a model keeps none (the Llama drafter does)."""
    target, drafter, expected = recurrent
    engine = SpeculativeEngine(target, {"llama": tiny_llama(1, layers=1), "own": drafter,
                                        "ngram": NGramDrafter(), "lookup+model": HybridDrafter(drafter)},
                               prefix_cache_tokens=256)
    for arm in ("off", "llama:3", "own:4", "ngram:4", "lookup+model:3"):
        results = [engine.generate(p, arm, NEW) for p in PROMPTS]
        assert [r.tokens for r in results] == expected, arm
        assert not any(r.fell_back for r in results), arm
        if arm != "off":  # rejected drafts were rolled back, kept ones kept
            assert 0 < sum(r.metrics.accepted for r in results) < sum(r.metrics.drafted for r in results), arm
    assert not any(r.metrics.cached_prompt_tokens for r in results) and len(engine.runner.prefixes) == 0
    assert len(engine.drafters["llama"].runner.prefixes) == len(PROMPTS)  # each prompt with its output


def test_a_recurrent_model_is_refused_by_name_where_its_states_cannot_be_rolled_back():
    target = tiny_qwen3_next(0)
    with pytest.raises(ValueError, match="linear_attention layers, which a static cache cannot roll back"):
        SpeculativeEngine(target, static_cache=True)
    with pytest.raises(InvalidRequestError, match="linear_attention layers, which cannot run batched"):
        SpeculativeEngine(target).generate_batch(PROMPTS[:2], "off", max_new_tokens=4)


def test_a_model_whose_longer_steps_restart_its_state_decodes_off_only():
    """Mamba takes its cache as `cache_params`, and reads its recurrent state only in a one-token
    step: a step of several tokens starts from zero, so a verify would decode something else,
    silently (generate() never feeds it more than one token). It still decodes OFF, and any
    drafter, or Mamba as one, is refused by name."""
    mamba = build(transformers.MambaConfig(hidden_size=64, num_hidden_layers=2, state_size=8, **COMMON), 0)
    engine = SpeculativeEngine(mamba)
    assert [engine.generate(p, "off", NEW).tokens for p in PROMPTS] == [hf_greedy(mamba, p, NEW) for p in PROMPTS]
    with pytest.raises(IncompatibleDrafterError, match=r"the target \(MambaForCausalLM\) cannot verify drafts"):
        engine.add_drafter("ngram", NGramDrafter())
    with pytest.raises(IncompatibleDrafterError, match=r"drafter 'mamba' \(MambaForCausalLM\) cannot draft"):
        SpeculativeEngine(tiny_llama(0), {"mamba": mamba})
    gemma = build(transformers.RecurrentGemmaConfig(num_hidden_layers=3, attention_window_size=WINDOW,
                                                    lru_width=64, head_dim=16, **SHAPE), 0)
    with pytest.raises(ValueError, match="RecurrentGemmaForCausalLM keeps no state in the cache"):
        SpeculativeEngine(gemma)  # its states live in its modules


ALIBI = {  # name: layers -> config
    "mpt": lambda n: transformers.MptConfig(n_layers=n, d_model=64, n_heads=4, max_seq_len=256, vocab_size=64,
                                            initializer_range=0.3),
    "falcon": lambda n: transformers.FalconConfig(num_hidden_layers=n, hidden_size=64, num_attention_heads=4,
                                                  alibi=True, initializer_range=0.3, **COMMON),
}


@pytest.mark.parametrize("kind", list(ALIBI))
def test_alibi_models_decode_one_request_at_a_time_on_the_dynamic_cache_only(kind):
    """MPT and Falcon (with `alibi`) bias attention by ALiBi, which transformers works out from
    cache slots or a 2-D mask: alone on the dynamic cache (slots are positions) they are
    lossless, also from kept prefixes (their slots are still positions); in a batch the holes
    shifted MPT's and it decoded other tokens, and a static cache's length threw Falcon's off
    (the request failed)."""
    target = build(ALIBI[kind](2), 0)
    engine = SpeculativeEngine(target, {"small": build(ALIBI[kind](1), 1), "ngram": NGramDrafter()},
                               prefix_cache_tokens=256)
    expected = [hf_greedy(target, p, NEW) for p in PROMPTS]
    for arm in ("off", "small:3", "ngram:4"):  # from the second arm on, every prompt but PROMPTS[1] is kept
        results = [engine.generate(p, arm, NEW) for p in PROMPTS]
        assert [r.tokens for r in results] == expected, arm
        assert not any(r.fell_back for r in results), arm
    assert [r.metrics.cached_prompt_tokens for r in results] == [len(PROMPTS[0]) - 1, 0, len(PROMPTS[2]) - 1]
    name = type(target).__name__
    with pytest.raises(InvalidRequestError, match=f"{name} biases attention by ALiBi"):
        engine.generate_batch(PROMPTS[:2], "off", max_new_tokens=4)
    with pytest.raises(ValueError, match=f"{name} biases attention by ALiBi, which a static cache"):
        SpeculativeEngine(target, static_cache=True)
