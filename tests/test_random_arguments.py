"""Random arguments, right and wrong, get a result or an `InvalidRequestError` naming the
problem, never an error from deep inside. A throwaway version of this (6,800 calls) and one
for the server (8,500 bodies) found the wrong types met by TypeErrors, a 1-token prompt with
prompt_logprobs (IndexError), and values float32 cannot hold (a distribution of nan)."""

import random

import pytest
import torch

from autotune.control.controller import AutotuneController
from engine import OFF, Arm, InvalidRequestError, NGramDrafter, SamplingParams, SpeculativeEngine

WRONG = [None, True, -1, 0.5, 10**30, float("nan"), float("inf"), 1e-300, "", "x", [], [[]], {}, {1: 2}, [-1],
         [64], (1, 2), b"ab", torch.tensor(3), torch.tensor([1.5]), [1.5]]
OPTIONS = {"top_k": [1, 5, 0, -1], "min_p": [0.0, 0.2], "repetition_penalty": [1.3], "presence_penalty": [1.0],
           "frequency_penalty": [0.5], "min_tokens": [0, 3], "ignore_eos": [True, False], "stop_token_ids": [[1, 2]],
           "skip_special_tokens": [False], "logprobs": [0, 3], "prompt_logprobs": [0, 2], "logit_bias": [{5: 5.0}],
           "allowed_token_ids": [[5, 6, 7, 8]], "bad_words_ids": [[[5, 6]], [[7]]]}
PROMPTS = [[5, 6, 7, 8], [9], torch.tensor([5, 6, 7]), torch.tensor([[5, 6]]), (3, 4)]


def some(rng: random.Random, right: list, wrong_share: float = 0.2):
    return rng.choice(WRONG) if rng.random() < wrong_share else rng.choice(right)


@pytest.mark.parametrize("seed", range(4))
def test_random_arguments_get_a_result_or_an_error_naming_them(target, seed):
    rng = random.Random(seed)
    engine = SpeculativeEngine(target, {"self": target, "ngram": NGramDrafter()})
    controller = AutotuneController(engine, policy="ucb", arms=[OFF, Arm("self", 2), Arm("ngram", 3)], max_batch=4,
                                    min_baseline_steps=4)
    outcomes = {"served": 0, "refused": 0}
    for _ in range(60):
        prompt, max_new_tokens = some(rng, PROMPTS, 0.1), some(rng, [1, 4, 8], 0.1)
        options = {name: some(rng, right) for name, right in OPTIONS.items() if rng.random() < 0.2}
        sampling = dict(temperature=some(rng, [0, 0, 0.8], 0.1), top_p=some(rng, [1.0, 0.9], 0.1),
                        seed=some(rng, [None, 3], 0.1), **options)
        try:
            call = rng.choice(["engine", "batch", "controller"])
            if call == "controller":
                controller.generate(prompt, some(rng, [None, "code"], 0.1), max_new_tokens, **sampling)
            elif call == "engine":
                engine.generate(prompt, some(rng, ["off", "self:2", "ngram:4"], 0.1), max_new_tokens,
                                SamplingParams(**sampling))
            else:
                engine.generate_batch([prompt, [5, 6, 7]], some(rng, ["off", "self:2"], 0.1), max_new_tokens,
                                      [SamplingParams(**sampling), SamplingParams()])
            outcomes["served"] += 1
        except InvalidRequestError as exc:
            assert str(exc)
            outcomes["refused"] += 1
    controller.close()
    assert min(outcomes.values()) >= 10, outcomes  # both sides drawn
