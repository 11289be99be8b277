"""Request prompts meet the model family the way its training text did."""

import pytest
from transformers import AutoTokenizer

from autotune.data.classes import builtin_classes, edit_example, stdlib_functions
from autotune.train.zoo import DEFAULT_FAMILY_DIR


@pytest.mark.slow
def test_edit_prompts_end_on_a_token_boundary_of_the_text_the_family_trained_on():
    """The tokens of a prompt must be a prefix of the tokens of prompt + expected output, as in
    training; a prompt ending in a bare line break breaks this (BPE merges the break with the
    next line's indentation), and the target then starts a new definition instead of copying."""
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_FAMILY_DIR / "target")
    edit = builtin_classes(include_shared=False)["edit"]
    rest = {}
    for _, source, node in stdlib_functions():
        example = edit_example(source, node)
        if example is not None:
            instruction, edited = example
            first, *others = edited.split("\n")
            rest[instruction + first] = "\n" + "\n".join(others)
    for prompt in edit.prompts[:16]:
        ids = tokenizer(prompt)["input_ids"]
        assert tokenizer(prompt + rest[prompt])["input_ids"][: len(ids)] == ids
