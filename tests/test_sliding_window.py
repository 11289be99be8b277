"""Targets and drafters with sliding-window attention (Mistral; Qwen2 with mixed layer kinds).

transformers' own sliding-window cache keeps only the last window, which a speculative decoder
cannot roll back past; the engine keeps the history and applies the window in the masks. Every
output must still be the target's own greedy output once requests are longer than the window.
"""

import pytest
import torch
from test_engine import hf_greedy
from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

from engine import BatchRequest, NGramDrafter, SpeculativeEngine

WINDOW = 8
SHAPE = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256, initializer_range=0.3, bos_token_id=None, eos_token_id=None,
             pad_token_id=None)
PROMPTS = [list(range(3, 30)), list(range(10, 20)), [5, 6, 7] * 6]
NEW = 40


def mistral(seed: int, layers: int, window: int | None = WINDOW):
    torch.manual_seed(seed)
    return MistralForCausalLM(MistralConfig(num_hidden_layers=layers, sliding_window=window, **SHAPE)).eval()


def qwen2_mixed(seed: int, kinds: list[str]):
    torch.manual_seed(seed)
    config = Qwen2Config(num_hidden_layers=len(kinds), use_sliding_window=True, sliding_window=WINDOW,
                         layer_types=kinds, **SHAPE)
    return Qwen2ForCausalLM(config).eval()


MODELS = {
    "mistral": lambda: (mistral(0, 2), mistral(1, 1)),
    "qwen2-mixed": lambda: (qwen2_mixed(0, ["sliding_attention", "full_attention"]),
                            qwen2_mixed(1, ["sliding_attention"])),
}


@pytest.fixture(scope="module", params=list(MODELS))
def models(request):
    target, drafter = MODELS[request.param]()
    return target, drafter, [hf_greedy(target, p, NEW) for p in PROMPTS]


def test_the_window_shapes_these_outputs():
    """Without it the same weights decode otherwise: the tests below would catch a lost window."""
    assert [hf_greedy(mistral(0, 2), p, NEW) for p in PROMPTS] != [hf_greedy(mistral(0, 2, None), p, NEW)
                                                                  for p in PROMPTS]


@pytest.mark.parametrize("static_cache", [False, True])
def test_one_request_at_a_time_is_lossless_past_the_window(models, static_cache):
    target, drafter, expected = models
    engine = SpeculativeEngine(target, {"small": drafter, "ngram": NGramDrafter()}, static_cache=static_cache)
    for arm in ("off", "small:3", "ngram:4"):
        results = [engine.generate(p, arm, max_new_tokens=NEW) for p in PROMPTS]
        assert [r.tokens for r in results] == expected, arm
        assert not any(r.fell_back for r in results), arm  # rolled back past the window, no fallback


def test_a_batch_and_a_request_joining_it_are_lossless_past_the_window(models):
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
