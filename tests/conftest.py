"""Tiny random-weight models built in the test, so the suite runs in seconds on CPU."""

import os

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3NextConfig, Qwen3NextForCausalLM

if os.environ.get("PYTEST_XDIST_WORKER"):
    # One thread a worker process: the tiny models' ops gain nothing from a second, and two workers
    # each spinning two threads would oversubscribe the cores.
    torch.set_num_threads(1)


def tiny_llama(seed: int, layers: int = 2, vocab: int = 64, hidden: int = 64, context: int = 256):
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=context, initializer_range=0.3,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    return LlamaForCausalLM(config).eval()


def tiny_qwen3_next(seed: int, layers: int = 2, vocab: int = 64):
    """A hybrid model: gated linear-attention layers (a recurrent state, no KV cache) between
    full-attention ones, as Qwen3-Next and Qwen3.5 are."""
    torch.manual_seed(seed)
    config = Qwen3NextConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        layer_types=(["linear_attention", "full_attention"] * layers)[:layers], max_position_embeddings=256,
        initializer_range=0.3, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    return Qwen3NextForCausalLM(config).eval()


@pytest.fixture(scope="session")
def target():
    return tiny_llama(0, layers=2)


@pytest.fixture(scope="session")
def draft_model():
    return tiny_llama(1, layers=1)


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.slow)])
def store_url(request):
    """A fresh store's URL: a SQLite file, and a database of its own on the PostgreSQL server at
    $AUTOTUNE_TEST_POSTGRES_URL (`.ci/postgres start` starts one; CI sets
    AUTOTUNE_REQUIRE_POSTGRES=1 so that a missing server fails instead of skipping)."""
    from autotune.bench.common import fresh_stores

    server = os.environ.get("AUTOTUNE_TEST_POSTGRES_URL")
    if request.param == "postgresql" and not server:
        if os.environ.get("AUTOTUNE_REQUIRE_POSTGRES"):
            pytest.fail("AUTOTUNE_REQUIRE_POSTGRES is set but AUTOTUNE_TEST_POSTGRES_URL is not")
        pytest.skip("no PostgreSQL server: `.ci/postgres start DIR` prints a URL for AUTOTUNE_TEST_POSTGRES_URL")
    with fresh_stores(server) as fresh:
        yield fresh(request.param, "test")



def feature_head(target, seed: int = 0):
    """An untrained feature head (engine/feature.py) for `target`: its drafts are seldom kept,
    which a lossless test does not mind."""
    from engine.feature import FeatureDrafter, FeatureHead, HeadConfig

    torch.manual_seed(seed)
    config = target.config
    head = FeatureHead(HeadConfig(hidden=config.hidden_size, vocab_size=config.vocab_size,
                                  heads=config.num_attention_heads, ffn=2 * config.hidden_size, target_hash="test"))
    return FeatureDrafter(head.eval())
