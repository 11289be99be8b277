"""A new drafter kind is one class: defined here, registered, it is batched, replayed and lossless
with no other file changed."""

import pytest
import torch
from test_engine import prompts

from autotune.control.controller import default_arms
from autotune.rewards.replay import batch_rounds, replay_arm
from engine import OFF, Arm, IncompatibleDrafterError, SpeculativeEngine
from engine.drafters import Capabilities, RowByRow, reusable
from engine.replay import ReplayChains, ReplayInputs, lookup_chains
from engine.round import Drafts


class RepeatLast:
    """Drafts the last token k times: right wherever the target repeats itself."""

    capabilities = Capabilities(batch=True, replay=True)
    vocab_size = None
    max_length = None

    def begin(self, prompt: torch.Tensor, max_length: int) -> None:
        pass

    def propose(self, tokens, k, params, generator):
        return [tokens[-1]] * k, None

    def rollback(self, valid_length: int) -> None:
        pass

    def for_batch(self, target, reuse=None):
        return reusable(reuse, self) or RepeatLastBatch(self)

    def replay_chains(self, inputs: ReplayInputs) -> ReplayChains:
        chains, proposed = lookup_chains(self, inputs.sequence, inputs.start, inputs.k, inputs.target)
        return ReplayChains(chains, proposed)


class RepeatLastBatch(RowByRow):
    """Its batched step: every row's drafts at once."""

    def propose(self, rows, ks):
        return Drafts([[r.tokens[-1]] * k for r, k in zip(rows, ks)], [None] * len(rows))


def test_a_drafter_defined_here_is_batched_replayed_and_lossless(target):
    engine = SpeculativeEngine(target, {})
    engine.add_drafter("repeat", RepeatLast())
    assert Arm("repeat", 4) in default_arms(engine)
    batch = prompts(5, seed=3)
    limits = [10 + 4 * i for i in range(5)]
    alone = [engine.generate(p, OFF, n).tokens for p, n in zip(batch, limits)]
    for arm in (Arm("repeat", 1), Arm("repeat", 4)):
        served = engine.generate_batch(batch, arm, limits)
        assert [r.tokens for r in served] == alone, arm  # greedy: the target's own output
        assert served.metrics.drafted > 0 and served.metrics.accepted > 0, arm
        replayed = batch_rounds([replay_arm(engine, arm, p, o, n) for p, o, n in zip(batch, alone, limits)])
        assert (len(replayed), sum(replayed)) == (served.metrics.rounds, served.metrics.draft_steps), arm


def test_a_drafter_that_declares_what_it_cannot_do_is_refused_by_name(target):
    class Claims(RepeatLast):
        for_batch = None  # declares batch=True without the call

    with pytest.raises(IncompatibleDrafterError, match=r"lacks for_batch \(for batch=True\)"):
        SpeculativeEngine(target, {}).add_drafter("claims", Claims())
