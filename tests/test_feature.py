"""Feature drafting (engine/feature.py): lossless on every path, handed the target's own
features of exactly the committed positions, trained well enough to pay on the committed
family, and refusing a head trained for another target."""

import pytest
import torch
from conftest import feature_head, tiny_llama
from test_engine import hf_greedy, prompts
from transformers import AutoTokenizer

from autotune.train.head_training import head_losses
from autotune.train.zoo import DEFAULT_FAMILY_DIR, load_engine, sample_from
from engine import HybridDrafter, IncompatibleDrafterError, RoundControl, SamplingParams, SpeculativeEngine
from engine.feature import FeatureDrafter


@pytest.mark.parametrize("cache", ["dynamic", "static", pytest.param("prefix-cached", marks=pytest.mark.slow)])
def test_greedy_equals_target_generate_and_the_head_gets_each_committed_positions_features(target, cache,
                                                                                          monkeypatch):
    """With prefixes kept, later prompts prefill only their tail: features start there."""
    handed: dict[int, torch.Tensor] = {}
    take = FeatureDrafter.take_features

    def recording(self, start, hidden):
        for i, row in enumerate(hidden):
            handed[start + i] = row.clone()
        take(self, start, hidden)

    monkeypatch.setattr(FeatureDrafter, "take_features", recording)
    head = feature_head(target)
    engine = SpeculativeEngine(target, {"feature": head, "ngram+feature": HybridDrafter(head)},
                               static_cache=cache == "static",
                               prefix_cache_tokens=1024 if cache == "prefix-cached" else 0)
    reused = 0
    for i, prompt in enumerate(prompts(8)):
        max_new = 17 + i % 5
        reference = hf_greedy(target, prompt, max_new)
        # with OFF rounds among the drafter's (`probe_off`) too: the head is handed their features
        for arm, probes in (("feature:1", 0), ("feature:3", 0), ("ngram+feature:4", 0), ("feature:8", 0),
                            ("feature:3", 2), ("ngram+feature:4", 3)):
            handed.clear()
            result = engine.generate(prompt, arm, max_new_tokens=max_new, control=RoundControl(probe_off=probes))
            assert result.tokens == reference, (i, arm)
            assert not result.fell_back, result.fallback_error
            assert result.metrics.probe_rounds == probes
            reused += result.metrics.cached_prompt_tokens
            committed = prompt + result.tokens
            with torch.no_grad():
                own = target(torch.tensor([committed]), output_hidden_states=True).hidden_states[-1][0]
            first = result.metrics.cached_prompt_tokens
            assert sorted(handed) == list(range(first, len(committed) - 1)), (i, arm)  # each, once it is known
            # A wrong position's features differ by O(1); the same position's by rounding (a static
            # cache's step attends over its whole padded length, a sum in another order: 1.03e-5 seen)
            torch.testing.assert_close(torch.stack([handed[p] for p in sorted(handed)]), own[first:-1],
                                       atol=1e-4, rtol=1e-4)
    assert (reused > 0) == (cache == "prefix-cached")


def test_the_committed_head_drafts_what_the_target_decodes():
    """The family's head, trained by `autotune zoo train-head`: most first drafts are kept on code."""
    from autotune.data.classes import builtin_classes

    engine = load_engine(drafters=["feature"], ngram=False)
    drafted = accepted = 0
    for prompt in builtin_classes(include_shared=False)["code"].prompts[:3]:
        result = engine.generate(prompt, "feature:4", max_new_tokens=48)
        assert result.tokens == engine.generate(prompt, "off", max_new_tokens=48).tokens
        drafted += result.metrics.drafted_per_position[0]
        accepted += result.metrics.accepted_per_position[0]
    assert accepted / drafted > 0.7, (accepted, drafted)


@pytest.mark.parametrize("prefill_chunk", [None, 5], ids=["prefilled at once", "chunked prefill"])
def test_in_a_batch_each_row_drafts_and_keeps_what_it_does_alone(prefill_chunk):
    """Rows of a batch draft with a drafter of the head's each, handed the features the batch's
    prefill and verifies computed for that row: on the committed family every row's output,
    drafts and kept drafts are those it gets alone, also for rows joining the running batch
    (their prefill at once or a chunk a round)."""
    from autotune.data.classes import builtin_classes
    from engine import BatchRequest

    engine = load_engine(drafters=["feature"])  # with n-gram lookup and ngram+feature
    classes = builtin_classes(include_shared=False)
    batch = classes["code"].prompts[:2] + classes["docs"].prompts[:1]
    joiners = classes["edit"].prompts[:2]
    for arm in ("feature:3", "ngram+feature:4"):
        waiting = [BatchRequest(p, 32) for p in joiners]

        def admit(live: int, waiting: list = waiting) -> list:
            return [waiting.pop(0)] if waiting and live else []

        out = engine.generate_batch(batch, arm, 32, admit=admit, prefill_chunk=prefill_chunk)
        alone = [engine.generate(p, arm, 32) for p in batch + joiners]
        assert [r.tokens for r in out] == [a.tokens for a in alone], arm
        assert [(r.metrics.drafted, r.metrics.accepted) for r in out] == \
            [(a.metrics.drafted, a.metrics.accepted) for a in alone], arm
        assert sum(r.metrics.accepted for r in out) > 0.5 * sum(r.metrics.drafted for r in out)


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(1.0, 0.95, seed=5)])
def test_a_replay_predicts_the_committed_heads_rounds_exactly(sampling):
    """From one OFF request's output, the counterfactual replay (a target forward for the features,
    then every round's head steps at once) gives the rounds each feature arm then served: greedy,
    and sampled with a seed (coupled: the head's draws from the request's noise)."""
    from autotune.data.classes import builtin_classes
    from autotune.rewards.replay import replay_arm
    from engine import Arm

    engine = load_engine(drafters=["feature"])  # with n-gram lookup and ngram+feature
    classes = builtin_classes(include_shared=False)
    for prompt in classes["code"].prompts[:2] + classes["edit"].prompts[:2]:
        ids = engine.encode(prompt).tolist()
        output = engine.generate(ids, "off", 40, sampling).tokens
        for arm in (Arm("feature", 1), Arm("feature", 3), Arm("feature", 8), Arm("ngram+feature", 4)):
            served = engine.generate(ids, arm, 40, sampling).metrics
            rounds = replay_arm(engine, arm, ids, output, 40, sampling)
            assert (len(rounds), sum(rounds)) == (served.rounds, served.drafted), arm
    assert served.accepted < served.drafted  # sampled or not, some drafts were rejected


def test_a_replay_from_the_features_a_request_was_served_with_predicts_the_rounds_exactly():
    """Replayed from the features the head was handed serving one request (no target forward),
    its prompt's prefix kept so that they begin past its first position, each feature arm's
    replay gives the rounds that arm then served (reusing as much of the prompt)."""
    from autotune.data.classes import builtin_classes
    from autotune.rewards.replay import replay_arm, served_features
    from engine import Arm

    engine = load_engine(drafters=["feature"], prefix_cache_tokens=4096)
    for prompt in builtin_classes(include_shared=False)["edit"].prompts[:3]:
        ids = engine.encode(prompt).tolist()
        engine.generate(ids, "off", max_new_tokens=1)  # keeps the prompt: every request below reuses it
        result = engine.generate(ids, "feature:4", max_new_tokens=40)
        features = served_features(engine.drafters["feature"])
        assert features.first == result.metrics.cached_prompt_tokens > 0
        for arm in (Arm("feature", 2), Arm("feature", 8), Arm("ngram+feature", 3), Arm("ngram+feature", 6)):
            served = engine.generate(ids, arm, max_new_tokens=40).metrics
            assert served.cached_prompt_tokens == features.first
            rounds = replay_arm(engine, arm, ids, result.tokens, 40, features=features)
            assert (len(rounds), sum(rounds)) == (served.rounds, served.drafted), arm


def test_training_fits_the_head_to_the_targets_own_text(target):
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    text = sample_from(target, torch.randint(0, 64, (8, 4), generator=gen), 28, gen, greedy=True)
    head = feature_head(target).head.train()
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    _, before = head_losses(head, target, text, 0.2)
    for _ in range(120):
        loss, _ = head_losses(head, target, text, 0.2)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
    _, after = head_losses(head, target, text, 0.2)
    assert before["agree_1"] < 0.2 and after["agree_1"] > 0.6 and after["agree_2"] > 0.4, (before, after)


@pytest.mark.parametrize("batched", [False, True], ids=["alone", "in a batch"])
def test_a_head_that_raises_mid_request_leaves_it_to_off(target, monkeypatch, batched):
    """The head's eager steps are `step_rows`, alone (a batch of one row) or for every row of a batch."""
    head = feature_head(target)
    engine = SpeculativeEngine(target, {"feature": head})
    calls = {"n": 0}
    original = type(head.head).step_rows

    def failing(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("head blew up")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(type(head.head), "step_rows", failing)
    batch = prompts(3, seed=6) if batched else prompts(2, seed=5)[1:]
    results = engine.generate_batch(batch, "feature:3", 30).results if batched else \
        [engine.generate(batch[0], "feature:3", max_new_tokens=30)]
    assert [r.tokens for r in results] == [hf_greedy(target, p, 30) for p in batch]
    assert all(r.fell_back and "head blew up" in r.fallback_error for r in results)
    assert sum(r.metrics.drafted for r in results) > 0


def test_a_head_for_another_target_is_refused_by_name(target, tmp_path):
    target.save_pretrained(tmp_path / "target")
    AutoTokenizer.from_pretrained(DEFAULT_FAMILY_DIR / "target").save_pretrained(tmp_path / "target")
    engine = SpeculativeEngine(tmp_path / "target")
    assert engine.target_hash is not None
    with pytest.raises(IncompatibleDrafterError, match=r"'other'.*trained for the target with weights test"):
        engine.add_drafter("other", feature_head(target))  # its hash is "test"
    with pytest.raises(IncompatibleDrafterError, match=r"'wide'.*hidden size 128, the target's is 64"):
        engine.add_drafter("wide", feature_head(tiny_llama(0, layers=1, hidden=128)))
    with pytest.raises(IncompatibleDrafterError, match=r"vocabulary size 96, the target's is 64"):
        engine.add_drafter("big", feature_head(tiny_llama(0, layers=1, vocab=96)))
    assert not engine.drafters


def test_a_saved_head_loads_by_folder_and_drafts_the_same(target, tmp_path):
    head = feature_head(target)
    head.head.save(tmp_path / "head")
    engine = SpeculativeEngine(target, {"saved": tmp_path / "head", "live": head})
    assert isinstance(engine.drafters["saved"], FeatureDrafter)
    for prompt in prompts(3, seed=4):
        saved, live = (engine.generate(prompt, f"{name}:4", 20).metrics for name in ("saved", "live"))
        assert saved.accepted_per_position == live.accepted_per_position
    torch.testing.assert_close(engine.drafters["saved"].head.fuse.weight, head.head.fuse.weight)
