"""lab/probes/llada2_multiply_working.py: each step of a written multiply working checked
on its own."""

from __future__ import annotations

import importlib

import pytest

from lab.tasks import TEST, Instance, _split_of, multiply_factors


def _benchmark():
    return importlib.import_module("lab.probes.llada2_multiply_working")


# 39 * 35: p0 = 39 * 5 = 195, p1 = 39 * 30 = 1170, product 1365.
PRODUCT = Instance("multiply", "mul 39*35=", "195+1170=1365")
FORM, P0, P1, BOTH, ADDS, RIGHT, WHOLE = (
    "written as p0+p1=product", "p0 right", "p1 right", "both partial products right",
    "product = p0 + p1 as written", "product right", "whole answer right")


@pytest.mark.parametrize("predicted, passed", [
    (" 195+1170=1365\n", {FORM, P0, P1, BOTH, ADDS, RIGHT, WHOLE}),
    ("000195+001170=001365", {FORM, P0, P1, BOTH, ADDS, RIGHT, WHOLE}),  # the padded layout
    ("195+1170=1195", {FORM, P0, P1, BOTH}),  # the partial products, not their sum
    ("195+1180=1375", {FORM, P0, ADDS}),  # adds what it wrote, one product wrong
    ("185+1170=1365", {FORM, P1, RIGHT}),
    ("1365", {RIGHT}),  # the product alone
    ("1366", set()),
    ("195++1170=1365", set()),
    ("", set()),
])
def test_each_step_of_the_working_is_checked(predicted, passed):
    assert _benchmark().checks(PRODUCT, predicted) == passed


def test_products_write_their_working_and_are_held_out():
    items = _benchmark().products(40, seed=0)
    assert items == _benchmark().products(40, seed=0) and len({i.prompt for i in items}) > 30
    for item in items:
        a, b = multiply_factors(item.prompt)
        assert a >= 10 and 10 <= b <= 99 and _split_of(item.prompt) == TEST
        assert _benchmark().checks(item, item.answer) == set(_benchmark().CHECKS)


def test_table_lists_every_check_and_the_examples():
    module = _benchmark()
    result = {"n": 2, "passed": dict.fromkeys(module.CHECKS, 1), "examples": [["mul 39*35=", "195+1170=1365", "1365"]]}
    text = module.table(result)
    assert all(f"| {name} | 1 |" in text for name in module.CHECKS) and "| `mul 39*35=` |" in text
