"""Generated tasks: seeded, splits disjoint, answers right; the task tokenizer keeps
retrieval contexts short and digits/symbols one token each."""

from __future__ import annotations

import random

import pytest

from vllm_dllm.tasks import TASKS, TEST, TRAIN, Instance, _split_of, char_score, score
from vllm_dllm.training.checkpoint import build_tokenizer


@pytest.mark.parametrize("name", list(TASKS))
def test_tasks_are_seeded_and_splits_disjoint(name):
    task = TASKS[name]
    a = [task.sample(random.Random(5), TRAIN) for _ in range(3)]
    b = [task.sample(random.Random(5), TRAIN) for _ in range(3)]
    assert a == b
    rng = random.Random(9)
    train = {task.sample(rng, TRAIN).prompt for _ in range(300)}
    test = {task.sample(rng, TEST).prompt for _ in range(100)}
    assert not train & test
    assert all(_split_of(p) == TEST for p in test) and all(_split_of(p) == TRAIN for p in train)


def test_answers_are_correct():
    rng = random.Random(0)
    for _ in range(50):
        inst = TASKS["addition"].sample(rng, TEST)
        a, b = inst.prompt.removeprefix("add ").removesuffix("=").split("+")
        assert int(inst.answer) == int(a) + int(b) and len(a) <= 6 and len(b) <= 6
        rev = TASKS["reverse"].sample(rng, TEST)
        assert rev.answer == rev.prompt.split(" ", 1)[1][::-1] and 16 <= len(rev.answer) <= 48
        ret = TASKS["retrieval"].sample(rng, TEST)
        body, query = ret.prompt.split("\n")[1:]
        pairs = dict(p.split("=") for p in body.split(";")[1:])
        assert 40 <= len(pairs) <= 120
        assert pairs[query.removeprefix("value of;").removesuffix("=")] == ret.answer
    assert score(ret, f" {ret.answer}\n") and not score(ret, ret.answer + "x")


def test_task_tokenizer_makes_retrieval_short_and_digits_single(tmp_path):
    from transformers import PreTrainedTokenizerFast

    ids = build_tokenizer(tmp_path, 512)
    tok = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    inst = TASKS["retrieval"].sample(random.Random(1), TEST)
    n_pairs = inst.prompt.count("=") - 1
    encoded = tok.encode(inst.prompt, add_special_tokens=False)
    assert len(encoded) <= 3 * n_pairs + 12
    assert tok.decode(encoded) == inst.prompt
    query_key = inst.prompt.rsplit("\n", 1)[1].removeprefix("value of")
    assert len(tok.encode(query_key, add_special_tokens=False)) == 1
    assert len(tok.encode(inst.answer, add_special_tokens=False)) == 2  # two capitals
    assert tok.encode("48213", add_special_tokens=False) == [ord(c) for c in "48213"]
    assert len(tok.encode("QWERTY", add_special_tokens=False)) == 6
    assert tok.decode(tok.encode("any text, even ünïcode!", add_special_tokens=False)) == "any text, even ünïcode!"
    assert ids["vocab_size"] % 64 == 0 and ids["mask"] < ids["vocab_size"]


def test_wilson_interval_brackets_the_observed_rate():
    from vllm_dllm.eval import wilson

    low, high = wilson(19, 20)
    assert 0.75 < low < 0.95 < high <= 1.0
    assert wilson(0, 20)[0] == 0.0 and 0.0 < wilson(0, 20)[1] < 0.2
    assert wilson(0, 0) == (0.0, 1.0)


def test_char_score_gives_positional_partial_credit():
    inst = Instance("copy", "copy ABCD", "ABCD")
    assert char_score(inst, "ABCD") == 1.0
    assert char_score(inst, " ABXD\n") == 0.75
    assert char_score(inst, "BCD") == 0.0  # shifted by one: nothing in place
    assert char_score(inst, "AB") == 0.5 and char_score(inst, "") == 0.0
