"""The compiled decode path (persistent static cache, one torch.compile graph per step length)
is as lossless as the eager one, and compiles everything before serving."""

import pytest
from conftest import feature_head
from test_engine import hf_greedy, prompts

from engine import HybridDrafter, LayerSkipDrafter, NGramDrafter, SamplingParams, SpeculativeEngine
from engine.feature import FeatureDrafter

ARMS = ["off", "small:3", "ngram:3", "hybrid:3", "feature:3", "skip:3"]


pytestmark = pytest.mark.slow  # compiled steps: a warm-up compiles every graph first


@pytest.fixture(scope="module")
def head(target):
    return feature_head(target)


def eager_drafters(draft_model, head) -> dict:
    return {"small": draft_model, "ngram": NGramDrafter(max_ngram=3), "hybrid": HybridDrafter(draft_model),
            "feature": FeatureDrafter(head.head),  # the same head, drafting for this engine
            "skip": LayerSkipDrafter({1})}  # the target without its second layer


@pytest.fixture(scope="module")
def compiled(target, draft_model, head):
    drafters = eager_drafters(draft_model, head)
    engine = SpeculativeEngine(target, drafters, compile=True, prefix_cache_tokens=1024)  # prompts >= 17 tokens reuse
    return engine, engine.warm_up(ARMS)


def test_warm_up_compiles_every_step_length_and_serving_compiles_nothing_more(compiled):
    engine, report = compiled
    assert engine.cache_kind == "compiled"
    assert set(report["target"]) == {"1->1", "2->2", "3->3", "4->4"}  # OFF, and K+1 for K = 1..3
    # 1 token, or 2 after a fully accepted draft; and greedy rounds of K = 1..3 drafts after either, one graph each
    rounds = {"1->1", "2->1"} | {f"{t}->{k} drafts" for t in (1, 2) for k in (1, 2, 3)}
    assert set(report["small"]) == rounds
    assert set(report["hybrid"]) == rounds  # its model catches up on lookup rounds 2 tokens a step
    assert set(report["feature"]) == {"round of 1", "round of 2", "round of 3"}  # a round's draft steps: one graph
    assert set(report["skip"]) == {"1->1", "1->1 drafts", "1->2 drafts", "1->3 drafts"}  # into the target's cache
    assert "ngram" not in report  # no model, nothing to compile
    for prompt in prompts(4, seed=2):
        for arm in ARMS:
            engine.generate(prompt, arm, max_new_tokens=19)
    assert engine.compile_report() == report


def test_compiled_greedy_equals_target_generate(compiled, target, draft_model, head):
    engine, _ = compiled
    # Prefixes kept as the compiled engine keeps them: a feature head drafts from the features
    # of the positions prefilled, which a kept prefix spares.
    eager = SpeculativeEngine(target, eager_drafters(draft_model, head), prefix_cache_tokens=1024)
    accepted = reused = 0
    for i, prompt in enumerate(prompts(10)):
        max_new = 17 + i % 5  # the last draft crosses max_new_tokens: shorter verify steps
        reference = hf_greedy(target, prompt, max_new)
        for arm in ARMS:
            result = engine.generate(prompt, arm, max_new_tokens=max_new)
            assert result.tokens == reference, (i, arm)
            # Same drafts as eager: the drafter runs its own graph, not the target's (same code, other weights).
            assert result.metrics.accepted == eager.generate(prompt, arm, max_new_tokens=max_new).metrics.accepted
            accepted += result.metrics.accepted
            reused += result.metrics.cached_prompt_tokens  # the static cache written from kept prompts
    assert accepted > 0 and reused > 0


def test_compiled_sampling_matches_the_eager_engine_draw_for_draw(compiled, target, draft_model, head):
    engine, _ = compiled
    eager = SpeculativeEngine(target, eager_drafters(draft_model, head))
    params = SamplingParams(temperature=0.8, seed=5)
    for prompt in prompts(4, seed=9):
        for arm in ARMS:
            assert engine.generate(prompt, arm, 20, params).tokens == eager.generate(prompt, arm, 20, params).tokens


def test_a_request_longer_than_the_compiled_cache_is_served_on_the_eager_path(target, draft_model):
    engine = SpeculativeEngine(target, {"small": draft_model}, compile=True, compiled_cache_len=24)
    prompt = prompts(1, seed=6)[0]  # 12 tokens + 30 new > 24 positions
    for arm in ("off", "small:3"):
        assert engine.generate(prompt, arm, max_new_tokens=30).tokens == hf_greedy(target, prompt, 30)
    assert engine.compile_report() == {"target": {}}  # nothing was compiled for it
