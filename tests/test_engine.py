"""The engine is lossless: greedy output equals the target's own `generate()` token for token."""

import pytest
import torch
from conftest import tiny_llama, tiny_qwen3_next

from engine import (
    Arm,
    Capabilities,
    HeuristicK,
    HybridDrafter,
    IncompatibleDrafterError,
    InvalidRequestError,
    ModelDrafter,
    NGramDrafter,
    RoundControl,
    SamplingParams,
    SpeculativeEngine,
)


class AlwaysWrongDrafter(ModelDrafter):
    """The target itself as drafter, with every proposal shifted by one: never accepted."""

    capabilities = Capabilities()  # its proposals are its own: a batch's steps or a replay would not make them

    def propose(self, tokens, k, params, generator):
        draft, _ = super().propose(tokens, k, params, generator)
        return [(t + 1) % self.vocab_size for t in draft], None


class FailingDrafter(ModelDrafter):
    """Raises at its `fail_at`-th proposal (0: in its prefill, before any)."""

    capabilities = Capabilities()

    def __init__(self, model, fail_at: int):
        super().__init__(model)
        self.calls, self.fail_at = 0, fail_at

    def begin(self, prompt, max_length):
        if self.fail_at == 0:
            raise RuntimeError("drafter blew up")
        super().begin(prompt, max_length)

    def propose(self, tokens, k, params, generator):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("drafter blew up")
        return super().propose(tokens, k, params, generator)


def hf_greedy(model, prompt, max_new_tokens, eos=None, **options):
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
        eos_token_id=eos, pad_token_id=0, **options,
    )
    return out[0, len(prompt):].tolist()


def prompts(n, vocab=64, seed=7):
    gen = torch.Generator().manual_seed(seed)
    # Some prompts repeat a pattern so n-gram lookup finds matches and gets accepted too.
    out = []
    for i in range(n):
        p = torch.randint(0, vocab, (4 + i % 9,), generator=gen).tolist()
        out.append(p * 3 if i % 3 == 0 else p)
    return out


@pytest.fixture(scope="module", params=[pytest.param(True, marks=pytest.mark.slow), False],
                ids=["static-cache", "dynamic-cache"])
def engine(request, target, draft_model):
    return SpeculativeEngine(
        target,
        {
            "small": draft_model,
            "self": target,  # always right
            "wrong": AlwaysWrongDrafter(target),
            "ngram": NGramDrafter(max_ngram=3),
            "hybrid": HybridDrafter(draft_model),
        },
        static_cache=request.param,
    )


def test_greedy_equals_target_generate_for_every_drafter_and_k(engine, target):
    accepted = {name: 0 for name in engine.drafters}
    for i, prompt in enumerate(prompts(20)):
        max_new = 17 + i % 5  # not a multiple of K+1: the last draft crosses max_new_tokens
        reference = hf_greedy(target, prompt, max_new)
        assert engine.generate(prompt, "off", max_new_tokens=max_new).tokens == reference
        for name in engine.drafters:
            for k in (1, 2, 4, 8):
                result = engine.generate(prompt, Arm(name, k), max_new_tokens=max_new)
                assert result.tokens == reference, (i, name, k)
                assert len(result.tokens) == max_new
                accepted[name] += result.metrics.accepted
                if name == "self":
                    assert result.metrics.acceptance == 1.0
                if name == "wrong":
                    assert result.metrics.accepted == 0
    assert accepted["small"] > 0 and accepted["ngram"] > 0 and accepted["hybrid"] > 0


def test_a_hybrid_drafts_by_lookup_where_the_context_repeats_and_its_model_catches_up_elsewhere(draft_model):
    hybrid, plain = HybridDrafter(draft_model), ModelDrafter(draft_model)
    greedy = SamplingParams()
    prompt = [5, 9, 2, 7, 30, 41]
    hybrid.begin(torch.tensor(prompt), 64)
    tokens = prompt + [5, 9]  # "5 9" occurred before: lookup proposes what followed it
    assert hybrid.propose(tokens, 3, greedy, None) == ([2, 7, 30], None)
    hybrid.rollback(len(tokens) + 3)
    tokens += [2, 7, 30, 11, 12]  # lookup's drafts kept, then text that repeats nothing
    draft, _ = hybrid.propose(tokens, 4, greedy, None)
    # The model caught up on the 7 tokens it skipped: its drafts are those of a model fed everything.
    plain.begin(torch.tensor(tokens[:-1]), 64)
    assert draft == plain.propose(tokens, 4, greedy, None)[0]


def test_eos_inside_an_accepted_draft_stops_exactly_there(target):
    prompt = prompts(1, seed=3)[0]
    free_run = hf_greedy(target, prompt, 30)
    eos = free_run[6]  # the target emits this token 7th: make it the EOS
    reference = hf_greedy(target, prompt, 30, eos=eos)
    assert reference[-1] == eos and len(reference) <= 7
    target.generation_config.eos_token_id = eos
    try:
        for static in (True, False):
            engine = SpeculativeEngine(target, {"self": target, "ngram": NGramDrafter()}, static_cache=static)
            for arm in ("off", "self:8", "self:3", "ngram:4"):
                result = engine.generate(prompt, arm, max_new_tokens=30)
                assert result.tokens == reference, (arm, static)
    finally:
        target.generation_config.eos_token_id = None


def test_a_request_stops_at_its_own_stop_token_ids_inside_an_accepted_draft(target):
    """vLLM's `stop_token_ids`: the output ends at the first of them (kept), as generate() with
    them added to `eos_token_id` ends; alone and in a batch, greedy and sampled (a sampled
    output is the arm's own free-running one, cut there: its draws depend on the arm)."""
    engine = SpeculativeEngine(target, {"self": target, "ngram": NGramDrafter()})
    batch = prompts(3, seed=3)
    for sampling in (SamplingParams(), SamplingParams(1.0, seed=7)):
        stop = engine.generate(batch[0], "off", 30, sampling).tokens[6]  # a stop inside a draft of 8
        stopping = SamplingParams(sampling.temperature, seed=sampling.seed, stop_token_ids=[stop])
        if sampling.greedy:
            assert [engine.generate(p, "off", 30, stopping).tokens for p in batch] == [
                hf_greedy(target, p, 30, eos=stop) for p in batch]
        for arm in ("off", "self:8", "ngram:4"):
            free = [engine.generate(p, arm, 30, sampling).tokens for p in batch]
            expected = [f[:f.index(stop) + 1] if stop in f else f for f in free]
            assert expected != free  # the stop ends at least one request early
            reasons = ["stop" if stop in f else "length" for f in free]  # vLLM's finish_reason
            alone = [engine.generate(p, arm, 30, stopping) for p in batch]
            assert [r.tokens for r in alone] == expected and [r.finish_reason for r in alone] == reasons, arm
            together = engine.generate_batch(batch, arm, 30, [stopping] * 3)
            assert [r.tokens for r in together] == expected, arm
            assert [r.finish_reason for r in together] == reasons, arm
    with pytest.raises(InvalidRequestError, match="stop_token_ids must be token ids"):
        SamplingParams(stop_token_ids=[-1])


def test_min_tokens_holds_the_end_back_and_ignore_eos_drops_it_as_generate_does(target):
    """vLLM's `min_tokens` (transformers' min_new_tokens): before that many output tokens the
    target cannot pick the EOS or a stop token, also at a verify's later positions, alone and in a
    batch; `ignore_eos`: the model's EOS ends nothing."""
    batch = prompts(3, seed=3)
    free = [hf_greedy(target, p, 30) for p in batch]
    eos = free[0][2]  # the target's 3rd token for the first prompt
    held = [hf_greedy(target, p, 30, eos=eos, min_new_tokens=8) for p in batch]
    assert held[0][2] != eos and eos in held[0][8:]  # held back, then it ends the output
    target.generation_config.eos_token_id = eos
    try:
        engine = SpeculativeEngine(target, {"self": target, "ngram": NGramDrafter()})
        cases = [(SamplingParams(min_tokens=8), held), (SamplingParams(ignore_eos=True), free),
                 (SamplingParams(ignore_eos=True, stop_token_ids=[eos], min_tokens=8), held)]
        for sampling, expected in cases:
            for arm in ("off", "self:8", "ngram:4"):
                assert [engine.generate(p, arm, 30, sampling).tokens for p in batch] == expected, (sampling, arm)
                assert [r.tokens for r in engine.generate_batch(batch, arm, 30, [sampling] * 3)] == expected, arm
    finally:
        target.generation_config.eos_token_id = None


def assert_every_arm_decodes_as_one_token_decoding(engine, batch, free, cases) -> None:
    """For each (sampling, expected outputs) of `cases`: the options change every output from
    `free`, and each arm decodes `expected`, alone and in a batch; the target drafting for
    itself ("self") drafts with the options, so every draft is kept."""
    for sampling, expected in cases:
        assert all(e != f for e, f in zip(expected, free))
        for arm in ("off", "self:8", "ngram:4"):
            alone = [engine.generate(p, arm, 20, sampling) for p in batch]
            together = engine.generate_batch(batch, arm, 20, [sampling] * 3)
            assert [r.tokens for r in alone] == [r.tokens for r in together] == expected, (sampling, arm)
            if arm == "self:8":
                assert [r.metrics.acceptance for r in alone] == [1.0] * 3 and together.metrics.acceptance == 1.0


def test_penalties_see_each_verified_tokens_own_history(target):
    """Repetition, presence and frequency penalties: greedy output equal to one-token decoding
    with them (generate() for repetition_penalty; written out for presence and frequency), on
    every arm, alone and in a batch: a verify's later positions see the drafts before them. A
    model drafter drafts with them too: the target drafting for itself has every draft kept."""
    engine = SpeculativeEngine(target, {"self": target, "ngram": NGramDrafter()})
    batch = prompts(3, seed=3)

    def one_at_a_time(prompt, presence, frequency):
        seq = list(prompt)
        for _ in range(20):
            with torch.no_grad():
                logits = target(torch.tensor([seq])).logits[0, -1]
            counts = torch.bincount(torch.tensor(seq[len(prompt):], dtype=torch.long), minlength=logits.numel())
            seq.append(int((logits - frequency * counts - presence * (counts > 0).float()).argmax()))
        return seq[len(prompt):]

    free = [hf_greedy(target, p, 20) for p in batch]
    cases = [(SamplingParams(repetition_penalty=1.5), [hf_greedy(target, p, 20, repetition_penalty=1.5)
                                                       for p in batch]),
             (SamplingParams(presence_penalty=1.0, frequency_penalty=0.5), [one_at_a_time(p, 1.0, 0.5)
                                                                            for p in batch])]
    assert_every_arm_decodes_as_one_token_decoding(engine, batch, free, cases)


def test_logit_bias_and_allowed_tokens_act_as_generates_sequence_bias_and_prefix_constraint(target):
    """logit_bias and allowed_token_ids: greedy output equal to generate() with the same bias
    (one-token sequence_bias) and the same allowed tokens (prefix_allowed_tokens_fn), with a
    repetition penalty after them as generate() applies it, on every arm, alone and in a batch.
    The target drafting for itself drafts with them too, so every draft is kept."""
    engine = SpeculativeEngine(target, {"self": target, "ngram": NGramDrafter()})
    batch = prompts(3, seed=5)
    bias = {t: (3.0 if t % 3 else -2.5) for t in range(1, 64, 4)}
    allowed = list(range(0, 64, 2))
    free = [hf_greedy(target, p, 20) for p in batch]
    cases = [
        (SamplingParams(logit_bias=bias),
         [hf_greedy(target, p, 20, sequence_bias={(t,): b for t, b in bias.items()}) for p in batch]),
        (SamplingParams(logit_bias=bias, allowed_token_ids=allowed, repetition_penalty=1.5),
         [hf_greedy(target, p, 20, sequence_bias={(t,): b for t, b in bias.items()}, repetition_penalty=1.5,
                    prefix_allowed_tokens_fn=lambda _, ids: allowed) for p in batch]),
    ]
    assert all(t % 2 == 0 for t in sum(cases[1][1], []))
    assert_every_arm_decodes_as_one_token_decoding(engine, batch, free, cases)


def test_bad_words_act_as_generates_bad_words_ids(target):
    """bad_words_ids: the last token of a bad word whose other tokens end the text so far is
    impossible there, as in generate(bad_words_ids=...), at every verify position with its own
    drafts, on every arm, alone and in a batch (bad words of one, two and three tokens, taken
    from the free outputs so that each bites)."""
    engine = SpeculativeEngine(target, {"self": target, "ngram": NGramDrafter()})
    batch = prompts(3, seed=5)
    free = [hf_greedy(target, p, 20) for p in batch]
    words = [free[0][2:3], free[1][3:5], free[2][5:8]]
    expected = [hf_greedy(target, p, 20, bad_words_ids=words) for p in batch]
    assert_every_arm_decodes_as_one_token_decoding(engine, batch, free,
                                                   [(SamplingParams(bad_words_ids=words), expected)])


def none_of_the_last_four(input_ids, scores):
    """A caller's logits processor that depends on the history."""
    return scores.scatter(1, input_ids[:, -4:], float("-inf"))


def a_multiple_of_nine(input_ids, scores):
    """A caller's stopping criterion: met after a token id divisible by 9."""
    return input_ids[:, -1] % 9 == 0


def test_logits_processors_are_called_as_generate_calls_them(target):
    """A caller's `logits_processor` (a plain function, then with transformers' no-repeat-n-gram
    class before it): greedy output equal to generate(logits_processor=...), on every arm, alone
    and in a batch; each verify position calls them with its own history, and a model drafter
    drafts with them."""
    from transformers import LogitsProcessorList, NoRepeatNGramLogitsProcessor

    engine = SpeculativeEngine(target, {"self": target, "ngram": NGramDrafter()})
    batch = prompts(3, seed=13)
    free = [hf_greedy(target, p, 20) for p in batch]
    cases = []
    for processors in ([none_of_the_last_four], [NoRepeatNGramLogitsProcessor(2), none_of_the_last_four]):
        expected = [hf_greedy(target, p, 20, logits_processor=LogitsProcessorList(processors)) for p in batch]
        cases.append((SamplingParams(logits_processor=LogitsProcessorList(processors)), expected))
    assert cases[0][1] != cases[1][1]  # the n-gram rule bites too
    assert_every_arm_decodes_as_one_token_decoding(engine, batch, free, cases)


def test_a_verify_calls_the_processors_only_up_to_its_first_rejected_draft(target):
    """n-gram lookup drafts without the processors, so every call is the target's: one for the
    prefill's token and, per round, one per kept draft plus one for the token after them."""
    calls = []

    def counted(input_ids, scores):
        calls.append(input_ids.shape[1])
        return none_of_the_last_four(input_ids, scores)

    engine = SpeculativeEngine(target, {"ngram": NGramDrafter()})
    m = engine.generate(prompts(1)[0], "ngram:4", 30, SamplingParams(logits_processor=counted)).metrics
    assert m.drafted > m.accepted > 0
    assert len(calls) == 1 + m.rounds + m.accepted


def test_stopping_criteria_end_the_output_where_generate_ends_it(target):
    """A caller's `stopping_criteria`: the output ends at the first token after which one is met,
    also inside an accepted draft, as generate(stopping_criteria=...) ends it, on every arm, alone
    and in a batch (here after 6, 11 and 10 tokens)."""
    from transformers import StoppingCriteriaList

    engine = SpeculativeEngine(target, {"self": target, "ngram": NGramDrafter()})
    batch = prompts(3, seed=5)
    free = [hf_greedy(target, p, 20) for p in batch]
    expected = [hf_greedy(target, p, 20, stopping_criteria=StoppingCriteriaList([a_multiple_of_nine])) for p in batch]
    assert [len(e) for e in expected] == [6, 11, 10]
    sampling = SamplingParams(stopping_criteria=StoppingCriteriaList([a_multiple_of_nine]))
    assert_every_arm_decodes_as_one_token_decoding(engine, batch, free, [(sampling, expected)])


def test_every_logit_edit_and_end_at_once_act_as_generate_applies_them(target):
    """Bias, allowed tokens, bad words, repetition penalty, min_tokens, a stop id, a caller's
    processor and stopping criterion in one request: the same output as generate() with all of
    them, on every arm, alone and in a batch, so their order is generate()'s."""
    from transformers import LogitsProcessorList, StoppingCriteriaList

    engine = SpeculativeEngine(target, {"self": target, "ngram": NGramDrafter()})
    batch = prompts(3, seed=5)
    free = [hf_greedy(target, p, 20) for p in batch]
    bias = {t: (3.0 if t % 3 else -2.5) for t in range(1, 64, 4)}
    allowed = [t for t in range(64) if t % 5]
    words = [free[0][2:3], free[1][3:5]]
    expected = [hf_greedy(target, p, 20, eos=10, min_new_tokens=4, sequence_bias={(t,): b for t, b in bias.items()},
                          prefix_allowed_tokens_fn=lambda _, ids: allowed, bad_words_ids=words, repetition_penalty=1.3,
                          logits_processor=LogitsProcessorList([none_of_the_last_four]),
                          stopping_criteria=StoppingCriteriaList([a_multiple_of_nine])) for p in batch]
    assert [len(e) for e in expected] == [11, 20, 20]
    sampling = SamplingParams(stop_token_ids=[10], min_tokens=4, logit_bias=bias, allowed_token_ids=allowed,
                              bad_words_ids=words, repetition_penalty=1.3, logits_processor=[none_of_the_last_four],
                              stopping_criteria=[a_multiple_of_nine])
    assert_every_arm_decodes_as_one_token_decoding(engine, batch, free, [(sampling, expected)])


def test_bad_words_are_tokenized_as_written_and_after_a_space():
    from transformers import AutoTokenizer

    from autotune.train.zoo import DEFAULT_FAMILY_DIR

    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_FAMILY_DIR / "target")
    engine = SpeculativeEngine(tiny_llama(0, vocab=len(tokenizer)), tokenizer=tokenizer)
    resolved = engine.bad_words_as_ids(SamplingParams(bad_words=["return"], bad_words_ids=[[7]]))
    spelled = {tuple(tokenizer.encode(w, add_special_tokens=False)) for w in ("return", " return")}
    assert resolved.bad_words == () and set(resolved.bad_words_ids) == {(7,), *spelled} and len(spelled) == 2
    with pytest.raises(InvalidRequestError, match="bad_words need the engine's tokenizer"):
        SpeculativeEngine(tiny_llama(0)).generate([1, 2], "off", 5, SamplingParams(bad_words=["x"]))


def test_logprobs_are_the_targets_own_for_every_output_token(target):
    """`logprobs`: per output token, the chosen token's and the 2 likeliest tokens' log-probabilities
    under the target's raw distribution (one forward over prompt + output gives them), also for
    tokens a verify accepted; alone and in a batch, greedy and sampled, and cut with the output
    by a stop token."""
    engine = SpeculativeEngine(target, {"self": target, "ngram": NGramDrafter()})
    batch = prompts(3, seed=3)
    stop = engine.generate(batch[0], "off", 20).tokens[6]
    for sampling in (SamplingParams(logprobs=2, stop_token_ids=[stop]), SamplingParams(1.0, seed=5, logprobs=2)):
        for arm in ("off", "self:8", "ngram:4"):
            alone = [engine.generate(p, arm, 20, sampling) for p in batch]
            together = engine.generate_batch(batch, arm, 20, [sampling] * 3).results
            assert len(alone[0].tokens) == len(together[0].tokens) == (7 if sampling.greedy else 20)
            for p, r in zip(batch * 2, alone + together):
                with torch.no_grad():
                    logp = torch.log_softmax(target(torch.tensor([p + r.tokens])).logits[0, len(p) - 1:-1], -1)
                assert len(r.logprobs) == len(r.tokens)
                for j, (token, entry) in enumerate(zip(r.tokens, r.logprobs)):
                    assert set(entry) == {token, *logp[j].topk(2).indices.tolist()}, (arm, j)
                    assert torch.allclose(torch.tensor(list(entry.values())), logp[j, list(entry)], atol=1e-4)
    assert engine.generate(batch[0], "self:8", 5).logprobs is None  # only when asked for


def test_skip_special_tokens_false_keeps_them_in_the_text_and_its_stop_strings():
    from transformers import AutoTokenizer

    from autotune.train.zoo import DEFAULT_FAMILY_DIR

    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_FAMILY_DIR / "target")
    engine = SpeculativeEngine(tiny_llama(0, vocab=len(tokenizer)), tokenizer=tokenizer)
    special = tokenizer.eos_token
    only_it = dict(allowed_token_ids=[tokenizer.eos_token_id], ignore_eos=True)
    assert engine.generate([5, 6], "off", 3, SamplingParams(**only_it)).text == ""
    assert engine.generate([5, 6], "off", 3, SamplingParams(**only_it, skip_special_tokens=False)).text == special * 3
    kept = engine.generate([5, 6], "off", 3, SamplingParams(**only_it, stop=[special], skip_special_tokens=False))
    assert (kept.tokens, kept.text) == ([tokenizer.eos_token_id], "")  # the stop string is found in that text
    assert len(engine.generate([5, 6], "off", 3, SamplingParams(**only_it, stop=[special])).tokens) == 3


def test_prompt_logprobs_are_the_targets_own_for_every_prompt_token(target):
    """vLLM's `prompt_logprobs`: None for the first prompt token, then each one's and the 2
    likeliest tokens' log-probabilities given the tokens before it, alone and in a batch of
    prompts of different lengths (rows padded on the left)."""
    engine = SpeculativeEngine(target, {"ngram": NGramDrafter()})
    batch = prompts(3, seed=3)
    sampling = SamplingParams(prompt_logprobs=2)
    alone = [engine.generate(p, "ngram:4", 8, sampling) for p in batch]
    together = engine.generate_batch(batch, "ngram:4", 8, [sampling] * 3).results
    assert len({len(p) for p in batch}) == 3
    for p, r in zip(batch * 2, alone + together):
        with torch.no_grad():
            logp = torch.log_softmax(target(torch.tensor([p])).logits[0, :-1], -1)
        assert len(r.prompt_logprobs) == len(p) and r.prompt_logprobs[0] is None
        for j, (token, entry) in enumerate(zip(p[1:], r.prompt_logprobs[1:])):
            assert set(entry) == {token, *logp[j].topk(2).indices.tolist()}
            assert torch.allclose(torch.tensor(list(entry.values())), logp[j, list(entry)], atol=1e-4)
    assert [r.tokens for r in alone] == [r.tokens for r in together]
    assert engine.generate(batch[0], "ngram:4", 5).prompt_logprobs is None  # only when asked for
    assert engine.generate([5], "ngram:4", 2, sampling).prompt_logprobs == [None]  # a 1-token prompt has none


def test_a_request_stops_at_the_token_that_completes_one_of_its_stop_strings():
    """vLLM's `stop`: the output ends at the token whose text completes a stop string (kept), also
    inside an accepted draft, alone and in a batch; the engine looks only at the last tokens'
    text, the expected end is found on the whole text. The text ends before the stop string
    unless `include_stop_str_in_output`, as vLLM's does."""
    from transformers import AutoTokenizer

    from autotune.train.zoo import DEFAULT_FAMILY_DIR

    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_FAMILY_DIR / "target")
    target = tiny_llama(0, vocab=len(tokenizer))
    engine = SpeculativeEngine(target, {"self": target, "ngram": NGramDrafter()}, tokenizer=tokenizer)
    batch = [[(7 * i + 3 * j) % 2000 + 40 for j in range(6 + i)] for i in range(3)]
    free = [engine.generate(p, "off", 30).tokens for p in batch]
    text = tokenizer.decode(free[0][:12], skip_special_tokens=True)
    stop = text[-3:]  # completed by the first request's 12th token at the latest

    def cut(tokens, first=0):  # at the first token from `first` on whose text completes the stop string
        def count(n):
            return tokenizer.decode(tokens[:n], skip_special_tokens=True).count(stop)

        return next((tokens[:j + 1] for j in range(first, len(tokens)) if count(j + 1) > count(j)), tokens)

    expected = [cut(f) for f in free]
    assert expected[0] != free[0] and len(expected[0]) <= 12
    whole = tokenizer.decode(expected[0], skip_special_tokens=True)
    texts = [whole[:whole.index(stop)], whole]  # without the stop string, then with it
    for keep, arm in [(False, "off"), (False, "self:8"), (True, "ngram:4")]:
        stopping = SamplingParams(stop=["never in this text", stop], include_stop_str_in_output=keep)
        results = [engine.generate(p, arm, 30, stopping) for p in batch]
        assert [r.tokens for r in results] == expected, arm
        assert results[0].text == texts[keep], arm
        together = engine.generate_batch(batch, arm, 30, [stopping] * 3).results
        assert [r.tokens for r in together] == expected and together[0].text == texts[keep], arm
    later = SamplingParams(stop=stop, min_tokens=len(expected[0]))  # nothing ends the output before
    assert engine.generate(batch[0], "self:8", 30, later).tokens == cut(free[0], len(expected[0])) != expected[0]
    with pytest.raises(InvalidRequestError, match="stop strings need the engine's tokenizer"):
        SpeculativeEngine(target).generate(batch[0], "off", 5, SamplingParams(stop=stop))


def test_k_may_change_between_rounds(engine, target):
    for prompt in prompts(5, seed=11):
        reference = hf_greedy(target, prompt, 25)
        result = engine.generate(prompt, "small:2", max_new_tokens=25, schedule=HeuristicK())
        assert result.tokens == reference
        assert result.metrics.drafted > 0


@pytest.mark.parametrize("fail_at", [3, 0], ids=["a proposal", "its prefill"])
def test_a_failing_drafter_falls_back_to_off_and_the_request_is_served(target, fail_at):
    """Also a drafter whose prefill raises (that used to fail the request: found by injecting
    faults into random batches and requests)."""
    prompt = prompts(2, seed=5)[1]
    engine = SpeculativeEngine(target, {"flaky": FailingDrafter(target, fail_at)})
    result = engine.generate(prompt, "flaky:4", max_new_tokens=30)
    assert result.fell_back and "drafter blew up" in result.fallback_error
    assert result.tokens == hf_greedy(target, prompt, 30)
    assert (result.metrics.drafted > 0) == (fail_at > 0)  # it speculated before failing


@pytest.mark.parametrize("kind", ["llama", "qwen3next"])
def test_a_target_that_fails_a_verify_step_falls_back_to_off_and_the_request_is_served(kind):
    """A target whose wide step raises midway (here in its second layer, at the second verify; a
    model bug or memory in life): the step's first layer had already cached the drafts, so each
    layer is cut back by its own excess (cutting all by the first one's lost real positions)
    and OFF finishes the request."""
    target = tiny_llama(0) if kind == "llama" else tiny_qwen3_next(0)
    prompt = prompts(2, seed=5)[1]
    expected = hf_greedy(target, prompt, 30)
    engine = SpeculativeEngine(target, {"ngram": NGramDrafter(), "draft": tiny_llama(1, layers=1)})
    wide_steps = []

    def fail_the_second_verify(module, args, kwargs):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        if hidden.shape[1] > 1:
            wide_steps.append(hidden.shape[1])
            if len(wide_steps) == 3:  # the prefill, a verify, then this one
                raise RuntimeError("no kernel for this shape")

    hook = target.model.layers[1].register_forward_pre_hook(fail_the_second_verify, with_kwargs=True)
    try:
        result = engine.generate(prompt, "draft:4", max_new_tokens=30)
    finally:
        hook.remove()
    assert result.fell_back and result.fallback_error == "verify: RuntimeError: no kernel for this shape"
    assert result.tokens == expected
    assert result.metrics.drafted > 0


def test_off_rounds_among_a_requests_own_keep_it_lossless_and_are_told_apart(engine, target):
    """`probe_off` serves rounds at K = 0 with the drafter set: every drafter must take them (its
    cache lags a token or more behind), and the arm's own counters are what is left."""
    for i, prompt in enumerate(prompts(4, seed=5)):
        reference = hf_greedy(target, prompt, 24)
        for name in engine.drafters:
            result = engine.generate(prompt, Arm(name, 4), max_new_tokens=24, control=RoundControl(probe_off=3))
            assert result.tokens == reference, (i, name)
            m, own = result.metrics, result.metrics.without_probes()
            assert m.probe_rounds == 3 and 0 < m.probe_s < m.verify_s
            assert (own.rounds, own.new_tokens, own.drafted) == (m.rounds - 3, 21, m.drafted)
            assert own.verify_s == pytest.approx(m.verify_s - m.probe_s)
            assert own.total_s == pytest.approx(m.total_s - m.probe_s)
            assert sum(n for _, n in own.verify_by_width.values()) == own.rounds
            if name == "self":  # every round of its own drafted K tokens and kept them
                assert own.verify_by_width.get(1) is None and own.mean_accepted_length == 5.0
    assert engine.generate(prompts(1)[0], "off", 24, control=RoundControl(probe_off=3)).metrics.probe_rounds == 0


def test_metrics_add_up(engine):
    result = engine.generate(prompts(1)[0], "self:4", max_new_tokens=21)
    m = result.metrics
    assert m.new_tokens == 21 and m.prompt_tokens == 12
    assert m.accepted == m.drafted == sum(m.drafted_per_position)
    assert m.acceptance_per_position == [1.0] * 4
    assert m.rounds == 4  # 1 from prefill + 4 rounds of 5
    assert m.mean_accepted_length == 5.0
    assert 0 < m.prefill_s + m.draft_s + m.verify_s <= m.total_s * 1.01
    assert m.tokens_per_s > 0


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda e: e.generate([1, 2], "nope:4"), "unknown drafter 'nope'"),
        (lambda e: e.generate([1, 2], Arm("small", 17)), "K must be in 1..16"),
        (lambda e: e.generate([1, 2], "small:0"), "K must be in 1..16"),
        (lambda e: e.generate([], "off"), "prompt is empty"),
        (lambda e: e.generate([1] * 250, "off", max_new_tokens=10), "exceeds the target's context"),
        (lambda e: e.generate([1, 2], "off", sampling=SamplingParams(temperature=-1)), "temperature"),
        (lambda e: e.generate([1, 2], "off", sampling=SamplingParams(float("inf"))), "temperature must be a finite"),
        (lambda e: e.generate([1, 2], "off", sampling=SamplingParams("0.5")), "temperature must be a number"),
        (lambda e: e.generate([1, 2], "off", sampling=SamplingParams(1.0, seed=2**63)), "seed must be an int in"),
        (lambda e: e.generate([1, 2], "off", sampling=SamplingParams(top_p=0)), "top_p"),
        (lambda e: e.generate([1, 2], "off", sampling=SamplingParams(top_p=1.5)), "top_p"),
        (lambda e: e.generate([1, 2], "off", sampling=SamplingParams(1.0, top_k=-2)), "top_k must be an int >= 0"),
        (lambda e: e.generate([1, 2], "off", sampling=SamplingParams(1.0, top_k=2.5)), "top_k must be an int"),
        (lambda e: e.generate([1, 2], "off", sampling=SamplingParams(1.0, min_p=1.5)), "min_p"),
        (lambda e: e.generate([1, 2], "off", sampling=SamplingParams(min_tokens=-1)), "min_tokens"),
        (lambda e: e.generate([1, 2], "off", sampling=SamplingParams(logprobs=21)), "logprobs must be None or an int"),
        (lambda e: e.generate([1, 2], "off", sampling=SamplingParams(repetition_penalty=0)), "repetition_penalty"),
        (lambda e: e.generate([1, 2], "off", sampling=SamplingParams(repetition_penalty=float("inf"))),
         "repetition_penalty must be a finite"),
        (lambda e: e.generate([1, 2], "off", sampling=SamplingParams(presence_penalty=3)), "presence_penalty"),
        (lambda e: e.generate([1, 999], "off"), "out of vocabulary"),
        (lambda e: e.generate([1, 2], "off", sampling=SamplingParams(logit_bias={3: 101})), "logit_bias must map"),
        (lambda e: e.generate([1, 2], "off", sampling=SamplingParams(logit_bias={-1: 1})), "logit_bias must map"),
        (lambda e: e.generate([1, 2], "off", sampling=SamplingParams(allowed_token_ids=[])), "allowed_token_ids"),
        (lambda e: e.generate([1, 2], "off", sampling=SamplingParams(bad_words_ids=[[1], []])), "bad_words_ids must"),
        (lambda e: e.generate([1, 2], "off", sampling=SamplingParams(bad_words_ids=[[1, 80]])), r"range .*\[80\]"),
        (lambda e: e.generate([1, 2], "off", sampling=SamplingParams(allowed_token_ids=[5], stop_token_ids=[5],
                                                                     min_tokens=2)), "all end tokens"),
        (lambda e: e.generate([1, 2], "small:2", sampling=SamplingParams(logit_bias={64: 1.0})),
         r"sampling options are out of vocabulary range \(size 64\): \[64\]"),
        (lambda e: e.generate_batch([[1, 2]] * 2, "off", sampling=[SamplingParams(stop_token_ids=[70])] * 2),
         r"out of vocabulary range \(size 64\): \[70\]"),
        (lambda e: e.generate([1, 2], "off", sampling=SamplingParams(logits_processor=[None])),
         "logits_processor must be callables"),
        (lambda e: e.generate([1, 2], "small:2", sampling=SamplingParams(logits_processor=lambda ids, s: s[0])),
         r"must return scores of shape \(1, 64\), got torch.Size\(\[64\]\)"),
        (lambda e: e.generate([1, 2], "off", sampling=SamplingParams(stopping_criteria=[1])),
         "stopping_criteria must be callables"),
        (lambda e: e.generate("text", "off"), "needs a tokenizer"),
        (lambda e: e.generate("a\ud800", "off"), "the prompt is not valid Unicode text"),
        (lambda e: e.generate([1, 2], "off", 2, SamplingParams(min_tokens=3)),
         r"min_tokens \(3\) exceeds max_new_tokens \(2\)"),
        (lambda e: e.generate([1, 2], "off", streamer=5), r"a streamer needs put\(\) and end\(\) methods"),
        (lambda e: e.generate([1, 2], "small:2", control=RoundControl(probe_off=-1)),
         "probe_off must be an int >= 0, got -1"),
        (lambda e: e.generate_batch("abc", "off"), "prompts must be a list of prompts, got a single str"),
        # arguments of the wrong type are named, not met by a TypeError from deep inside
        (lambda e: e.generate([[1, 2]], "off"), r"a prompt is text, or token ids \(ints\) in a list or a tensor"),
        (lambda e: e.generate(torch.tensor([1.0, 2.0]), "off"), "a prompt is text, or token ids"),
        (lambda e: e.generate([1, 2], 3), "an arm must be an Arm or a string"),
        (lambda e: e.generate([1, 2], Arm("small", 2.0)), "an arm is a drafter's name and an int K"),
        (lambda e: e.generate([1, 2], "off", max_new_tokens="8"), "max_new_tokens must be an int >= 1, got '8'"),
        (lambda e: e.generate([1, 2], "off", sampling=SamplingParams(1.0, seed=True)), "seed must be an int"),
        (lambda e: e.generate([1, 2], "off", sampling=SamplingParams(logprobs=True)), "logprobs must be None or an"),
        (lambda e: e.generate([1, 2], "off", sampling=SamplingParams(stop=3)), "stop must be a str or a list"),
        (lambda e: e.generate([1, 2], "off", sampling=SamplingParams(logit_bias=[3])), "logit_bias must map"),
        (lambda e: e.generate([1, 2], "off", sampling=SamplingParams(ignore_eos=1)), "ignore_eos must be True or"),
    ],
)
def test_bad_input_raises_a_clear_error(engine, call, message):
    with pytest.raises(InvalidRequestError, match=message):
        call(engine)


def test_none_for_a_list_option_means_none_as_in_vllm():
    given = SamplingParams(stop=None, stop_token_ids=None, logit_bias=None, bad_words=None, bad_words_ids=None)
    assert given == SamplingParams()


def test_a_number_given_as_a_huge_int_is_taken_as_its_float(engine):
    """10**30 as an int overflowed the tensor op it scaled (a 500 from the server)."""
    as_int = engine.generate([1, 2, 3], "small:2", 8, SamplingParams(repetition_penalty=10**30))
    assert as_int.tokens == engine.generate([1, 2, 3], "off", 8, SamplingParams(repetition_penalty=1e30)).tokens


def test_drafter_with_another_vocabulary_is_refused(target):
    with pytest.raises(IncompatibleDrafterError, match="vocabulary size 32"):
        SpeculativeEngine(target, {"odd": tiny_llama(2, layers=1, vocab=32)})


def test_drafter_with_another_tokenizer_is_refused(target):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    def word_tokenizer(words):
        vocab = {w: i for i, w in enumerate(words)}
        return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token=words[0])))

    words = [f"w{i}" for i in range(64)]
    engine = SpeculativeEngine(target, tokenizer=word_tokenizer(words))
    with pytest.raises(IncompatibleDrafterError, match="tokenizer that does not match"):
        engine.add_drafter("other", tiny_llama(3, layers=1), tokenizer=word_tokenizer(words[::-1]))
