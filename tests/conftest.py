"""Tiny random-weight models built in the test, so the suite runs in seconds on CPU."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama(seed: int, layers: int = 2, vocab: int = 64, hidden: int = 64, context: int = 256):
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=context, initializer_range=0.3,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="session")
def target():
    return tiny_llama(0, layers=2)


@pytest.fixture(scope="session")
def draft_model():
    return tiny_llama(1, layers=1)
