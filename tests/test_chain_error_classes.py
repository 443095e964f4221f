"""benchmarks/llada2_chain_errors.py's classes of a chain answer: which hop went wrong,
and whether a wrong value letter is the link-table capital that sits where the hub
table's value does (two tokens after the hub)."""

from __future__ import annotations

import random

import pytest

from tests.conftest import benchmark_module
from vllm_dllm.tasks import ALL_TASKS, TEST, Instance



def _benchmark():
    return benchmark_module("llada2_chain_errors")


# Links ab and ef name hub C; the links after them name E and D: C's link-table capitals.
INSTANCE = Instance("chain", "chain\n;ab=C;cd=E;ef=C;gh=D\n;C=XY;E=GH;D=KL\nfollow;ab=", "C=XY")


@pytest.mark.parametrize("predicted, kind, chance", [
    (" C=XY", "correct", 0.0),
    ("E=GH", "wrong hub: another hub", 0.0),
    ("Q=XY", "wrong hub: not a hub", 0.0),
    ("", "wrong hub: not a hub", 0.0),
    ("C=X", "right hub, malformed value", 0.0),
    ("C=GH", "right hub, another hub's value", 0.0),
    ("C=EY", "right hub, first letter from the link table", 2 / 25),
    ("C=DQ", "right hub, first letter from the link table", 2 / 25),
    ("C=XQ", "right hub, second letter alone wrong", 0.0),
    ("C=ZZ", "right hub, other value", 2 / 25),
])
def test_a_chain_answer_is_classed_by_the_hop_that_went_wrong(predicted, kind, chance):
    assert _benchmark().classify(INSTANCE, predicted) == (kind, pytest.approx(chance))


def test_generated_instances_parse_and_fall_in_one_size_bucket():
    bench = _benchmark()
    rng = random.Random(0)
    items = [ALL_TASKS["chain"].sample(rng, TEST) for _ in range(40)]
    result = bench.tally(items, [i.answer for i in items[:30]] + ["" for _ in items[30:]])
    assert result["classes"]["correct"] == 30 and result["classes"]["wrong hub: not a hub"] == 10
    assert sum(sum(c.values()) for c in result["by_pairs"].values()) == 40
    assert "| correct | 30 |" in bench.table(result)
