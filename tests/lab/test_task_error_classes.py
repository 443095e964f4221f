"""lab/probes/llada2_task_errors.py's classes of sort and multiply answers: what went
wrong in a sorted list (a miscopied number, a dropped or repeated one, the order) and
which digit of a product went wrong first (the units, or a carry above them)."""

from __future__ import annotations

import importlib
import random

import pytest

from lab.tasks import ALL_TASKS, TEST, Instance


def _benchmark():
    return importlib.import_module("lab.probes.llada2_task_errors")


SORT = Instance("sort", "sort 430 41 988 41 265", "41 41 265 430 988")


@pytest.mark.parametrize("predicted, kind", [
    (" 41 41 265 430 988", "correct"),
    ("41 41 265 43O 988", "not a list of numbers"),
    ("", "not a list of numbers"),
    ("41 41 265 494 988", "a number not in the input, other"),
    ("41 41 265 431 988", "a number not in the input, one digit off"),
    ("41 41 265 4300 988", "a number not in the input, other"),
    ("41 265 430 988", "numbers dropped"),
    ("41 41 265 430 988 988", "numbers added"),
    ("41 41 265 265 988", "an input number repeated in place of another"),
    ("41 41 430 265 988", "right numbers, wrong order"),
])
def test_a_sort_answer_is_classed_by_what_went_wrong(predicted, kind):
    assert _benchmark().classify_sort(SORT, predicted) == kind


MULTIPLY = Instance("multiply", "mul 6634*61=", "6634+398040=404674")


@pytest.mark.parametrize("predicted, kind", [
    ("6634+398040=404674 ", "correct"),
    ("404674", "correct"),  # the product alone is an accepted answer
    ("6634+398041=404674", "product right, working wrong"),
    ("6634+39804=404674", "product right, working wrong"),
    ("6634+398040=40467", "wrong length or not a number"),
    ("6634+398040=4046a4", "wrong length or not a number"),
    ("6634+398040=404675", "units digit wrong"),
    ("404664", "units right, tens wrong"),
    ("6634+398040=400994", "units right, tens wrong"),
    ("6634+398040=414674", "units and tens right, higher digit wrong"),
])
def test_a_product_is_classed_by_its_lowest_wrong_digit(predicted, kind):
    assert _benchmark().classify_multiply(MULTIPLY, predicted) == kind


def test_sizes_are_the_instances_own():
    bench = _benchmark()
    assert bench.sort_size(SORT) == "5 numbers"
    assert bench.multiply_size(MULTIPLY) == "4x2 digits"


@pytest.mark.parametrize("task", ["sort", "multiply"])
def test_generated_instances_are_tallied_by_class_and_size(task):
    bench = _benchmark()
    rng = random.Random(0)
    items = [ALL_TASKS[task].sample(rng, TEST) for _ in range(40)]
    result = bench.tally(task, items, [i.answer for i in items[:25]] + ["x" for _ in items[25:]])
    assert result["classes"]["correct"] == 25 and sum(result["classes"].values()) == 40
    assert sum(c for c, _ in result["correct_by_size"].values()) == 25
    assert sum(t for _, t in result["correct_by_size"].values()) == 40
    if task == "sort":
        sizes = [int(s.split()[0]) for s in result["correct_by_size"]]
        assert sizes == sorted(sizes) and sizes[-1] == 10, "sizes in numeric order"


def test_the_table_shows_both_decodings_and_what_one_token_a_step_changed():
    bench = _benchmark()
    items = [SORT, SORT, SORT]
    default = ["41 41 265 430 988", "41 265 430 988", "41 41 265 430 988"]
    strict = ["41 41 265 430 988", "41 41 265 430 988", "41 41 265 265 988"]
    runs = {"default": {**bench.tally("sort", items, default), "forwards_per_token": 0.37},
            "one token a step": {**bench.tally("sort", items, strict), "forwards_per_token": 1.0}}
    right = [[bench.classify_sort(SORT, t) == "correct" for t in texts] for texts in (default, strict)]
    change = bench.compare(*right)
    assert change == {"fixed": 1, "broken": 1}
    text = bench.table({"tasks": {"sort": {"decodings": runs, "one token a step against default": change}}})
    assert "| numbers dropped | 1 | 0 |" in text and "| forwards per token | 0.37 | 1.00 |" in text
    assert "| 5 numbers | 2/3 | 2/3 |" in text and "1 wrong answers right, 1 right answers wrong" in text
