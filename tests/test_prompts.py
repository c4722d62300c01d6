"""Prompts as a Python user writes them: any sequence of ints (a list, a tuple, a `range`), numpy
ints, 1-D arrays and tensors; a string stays one prompt; anything else is refused by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tieredkv import LLM, SamplingParams
from tieredkv.prompts import prompt_list, token_ids

VOCAB = 512
GREEDY = SamplingParams(max_tokens=4, temperature=0.0)


@pytest.mark.parametrize("prompt", [range(5, 12), (5, 6, 7), [5, 6, 7], np.array([5, 6]), torch.tensor([5, 6]),
                                    [np.int64(5), np.uint16(6)]],
                         ids=["range", "tuple", "list", "numpy", "torch", "numpy-ints"])
def test_one_prompt_of_token_ids(prompt):
    [one] = prompt_list(prompt)
    assert token_ids(one, None, VOCAB) == [int(t) for t in prompt]


def test_a_batch_of_sequences():
    batch = prompt_list([range(5, 8), (9, 10), "a string"])
    assert [token_ids(p, None, VOCAB) for p in batch[:2]] == [[5, 6, 7], [9, 10]]
    assert batch[2] == "a string"
    assert prompt_list((range(3, 5), range(7, 9))) == [range(3, 5), range(7, 9)]  # a tuple of prompts
    assert prompt_list("hello") == ["hello"]  # a string is one prompt, not a sequence of characters
    assert prompt_list(range(0)) == prompt_list([]) == []  # no prompts, as an empty list


@pytest.mark.parametrize(
    "prompt, message",
    [(range(0), "prompt: is empty"),
     (range(510, 514), r"token ids must be integers in \[0, 512\); got \[512, 513\]"),
     (range(-1, 2), r"got \[-1\]"),
     ((5, "6"), r"got \['6'\]"),
     ({5, 6}, "prompt: expected a string or token ids, got set"),
     (iter([5, 6]), "prompt: expected a string or token ids, got list_iterator"),
     (b"\x05\x06", "prompt: got bytes"),
     (bytearray(b"\x05"), "prompt: got bytes")],
    ids=["empty", "out-of-vocab", "negative", "str-in-tuple", "set", "iterator", "bytes", "bytearray"],
)
def test_bad_prompts_are_refused_by_name(prompt, message):
    with pytest.raises(ValueError, match=message):
        token_ids(prompt, None, VOCAB)


def test_a_string_without_a_tokenizer_says_what_to_do():
    with pytest.raises(ValueError, match="needs a tokenizer in the model directory; pass token ids"):
        token_ids("hello", None, VOCAB)


def test_generate_takes_a_range_and_a_tuple():
    with LLM(model="tiny-llama", block_size=4, num_gpu_blocks=32) as llm:
        [expected] = llm.generate([list(range(5, 30))], GREEDY, use_tqdm=False)
        outs = llm.generate([range(5, 30), tuple(range(5, 30))], GREEDY, use_tqdm=False)
        [alone] = llm.generate(range(5, 30), GREEDY, use_tqdm=False)
    assert expected.finish_reason == "length" and len(expected.token_ids) == 4
    assert [o.token_ids for o in [*outs, alone]] == [expected.token_ids] * 3
    assert [o.prompt_token_ids for o in outs] == [list(range(5, 30))] * 2
