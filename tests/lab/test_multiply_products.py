"""lab/probes/llada2_multiply_products.py: products of a given size drawn from either
split, and which partial sum a wrong tens digit of a 2x2 product matches."""

from __future__ import annotations

import importlib

import pytest

from lab.tasks import TEST, TRAIN, Instance, _split_of


def _benchmark():
    return importlib.import_module("lab.probes.llada2_multiply_products")


@pytest.mark.parametrize("digits", [2, 3, 4])
@pytest.mark.parametrize("split", [TRAIN, TEST])
def test_products_have_the_asked_size_and_split(digits, split):
    items = _benchmark().products(digits, 30, split, seed=0)
    for item in items:
        a, b = _benchmark().factors(item)
        assert len(str(a)) == digits and 10 <= b <= 99, item.prompt
        assert _split_of(item.prompt) == split and item.answer.endswith(f"={a * b}")
    assert len({i.prompt for i in items}) > 20, "distinct draws, not one repeated"
    assert items == _benchmark().products(digits, 30, split, seed=0), "seeded"


# 23 * 45 = 1035: a0 b1 = 12, a1 b0 = 10, carry(a0 b0 = 15) = 1, tens (12 + 10 + 1) % 10 = 3.
# The answer writes the partial products 23 * 5 and 23 * 40 first; the product ends it.
PRODUCT = Instance("multiply", "mul 23*45=", "115+920=1035")


@pytest.mark.parametrize("predicted, explained", [
    ("115+920=1025", ["carry left out", "right -1"]),  # 22
    ("115+920=1015", ["a0*b1 left out", "right -2"]),  # 11
    ("115+920=1045", ["right +1"]),
    ("1045", ["right +1"]),  # the product alone, without its working
    ("115+940=1055", ["right +2"]),
    ("115+920=1095", []),
    (" 115+920=1035", None),  # the tens digit is right
    ("115+930=1035", None),  # the working wrong, the product's tens digit right
    ("115+920=135", None),  # the wrong length
    ("115+920=10x5", None),
])
def test_a_wrong_tens_digit_is_matched_to_the_partial_sums_that_give_it(predicted, explained):
    assert _benchmark().tens_explanations(PRODUCT, predicted) == explained


def test_table_reports_each_split_and_the_shares_of_wrong_tens():
    module = _benchmark()
    result = {"right": {"2x2": {TRAIN: [24, 80], TEST: [18, 80]}},
              "2x2 wrong tens": {"wrong": 9, "explained": dict.fromkeys(module.TENS_EXPLANATIONS, 1)}}
    text = module.table(result)
    assert "| 2x2 | 24/80 | 18/80 |" in text and "| carry left out | 1 | 0.11 |" in text
