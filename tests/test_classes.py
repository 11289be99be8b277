"""Request prompts meet the model family the way its training text did."""

import re

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


def test_a_requests_file_gives_its_classes_and_refuses_a_bad_line_by_its_number(tmp_path):
    from autotune.data.requests_file import RequestsFileError, read_requests

    path = tmp_path / "requests.jsonl"
    path.write_text('{"class": "chat", "prompt": "Hi", "temperature": 0.7, "top_p": 0.9}\n\n'
                    '{"class": "sum", "prompt": "Summarize: x", "max_new_tokens": 32}\n'
                    '{"class": "chat", "prompt": "Hello", "temperature": 0.7, "top_p": 0.9}\n', encoding="utf-8")
    classes = read_requests(path)
    assert list(classes) == ["chat", "sum"]
    assert classes["chat"].prompts == ("Hi", "Hello") and classes["chat"].temperature == 0.7
    assert classes["sum"].max_new_tokens == 32 and classes["sum"].temperature == 0.0
    for line, message in [('{"class": "a", "prompt": "x"}\n{"class": "a"}', "line 2: 'prompt'"),
                          ('{"class": "a", "prompt": "x"}\n[1]', "line 2: expected an object"),
                          ('{"class": "a", "prompt": "x"}\n{"class": "a", "prompt": "y", "temperature": 1}',
                           "line 2: class 'a' has sampling options"),
                          ('{"class": "a", "prompt": "x", "top_k": 5}', "line 1: unknown field(s) ['top_k']"),
                          ('{"class": "a", "prompt": "x", "max_new_tokens": 0}', "line 1: max_new_tokens"),
                          ('{"class": "a", "prompt": "x"', "line 1: not JSON"), ("", "no requests")]:
        path.write_text(line, encoding="utf-8")
        with pytest.raises(RequestsFileError, match=re.escape(message)):
            read_requests(path)
