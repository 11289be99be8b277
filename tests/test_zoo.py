"""Domain drafters: `autotune zoo train-drafter` and `train-head --domain` add a drafter to a family,
which `load_engine` then serves alone and as a hybrid after n-gram lookup, losslessly."""

import json
import shutil

import pytest

import autotune.train.head_training as head_training
import autotune.train.zoo as zoo
from autotune.data.corpus import shared_corpora_dir, stdlib_texts
from autotune.train.head_training import HeadSpec, train_head
from autotune.train.zoo import DEFAULT_FAMILY_DIR, FamilySpec, domain_texts, load_engine, train_drafter


@pytest.mark.slow
def test_a_domain_that_needs_the_shared_corpora_is_refused_by_name_without_them():
    with pytest.raises(ValueError, match="shared corpora"):
        domain_texts("prose", FamilySpec(), corpora=None)
    with pytest.raises(ValueError, match="unknown domain 'poetry'"):
        domain_texts("poetry", FamilySpec(), corpora=None)


@pytest.mark.slow
@pytest.mark.skipif(shared_corpora_dir() is None, reason="../shared/corpora absent")
def test_prose_training_text_holds_none_of_the_prompts_the_prose_classes_draw():
    from autotune.data.classes import builtin_classes

    training = "\n".join(domain_texts("prose", FamilySpec(), shared_corpora_dir()))
    classes = builtin_classes(include_shared=True)
    # t0 shows one passage under several templates, as prompt or as the completion asked for: a
    # split by row kept a fifth of the qa prompts' passages in training. (Structured prompts share
    # their tools' descriptions with training rows, as every request for a tool does.)
    prompts = [p for name in ("summarize", "qa", "math", "chat") for p in classes[name].prompts]
    cores = [p.removeprefix("User: ").removesuffix("\nAssistant:").removesuffix("\nAnswer:").strip()[-300:]
             for p in prompts]
    assert len(cores) >= 4 * 60 and not [c for c in cores if c in training]


@pytest.mark.slow
def test_a_drafter_and_a_head_trained_on_a_domain_join_the_family_and_decode_losslessly(tmp_path, monkeypatch):
    folder = tmp_path / "family"
    shutil.copytree(DEFAULT_FAMILY_DIR, folder)
    # a few files stand in for the domain's text: what is checked is where the drafter goes, not how well it drafts
    def few_files(domain, family, corpora, held_out=False):
        return stdlib_texts(held_out)[:8]

    monkeypatch.setattr(zoo, "domain_texts", few_files)
    monkeypatch.setattr(head_training, "domain_texts", few_files)
    heads = json.loads((folder / "family.json").read_text())["feature_heads"]
    report = train_drafter(folder, "distilled-x", "code", steps=3, progress=False)
    assert report["domain"] == "code" and report["spec"]["distill_from_target"]
    train_head(folder, HeadSpec(steps=2, generated=4), progress=False, out=folder / "feature-x")

    manifest = json.loads((folder / "family.json").read_text())
    assert manifest["drafters"][-1] == "distilled-x" and manifest["feature_heads"] == [*heads, "feature-x"]
    engine = load_engine(folder, drafters=["distilled-x", "feature-x"])
    assert {"distilled-x", "feature-x", "ngram+distilled-x", "ngram+feature-x"} <= set(engine.drafters)
    prompt = stdlib_texts(held_out=True)[0][:400]
    off = engine.generate(prompt, "off", max_new_tokens=32).tokens
    for arm in ("distilled-x:3", "ngram+distilled-x:3", "feature-x:3", "ngram+feature-x:3"):
        assert engine.generate(prompt, arm, max_new_tokens=32).tokens == off, arm
    with pytest.raises(ValueError, match="already the family's target or a feature head"):
        train_drafter(folder, "feature-x", "code", steps=1, progress=False)
