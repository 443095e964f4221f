"""lab/probes/llada2_chain_errors.py's classes of a chain answer: which hop went wrong,
and whether a wrong value letter is the link-table capital that sits where the hub
table's value does (two tokens after the hub)."""

from __future__ import annotations

import importlib
import random

import pytest

from lab.tasks import ALL_TASKS, TEST, Instance



def _benchmark():
    return importlib.import_module("lab.probes.llada2_chain_errors")


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


# Query ef names F, the last hub row; D is the row before it, and the links beside ef
# name D and E.  A row neighbour that is also a link neighbour counts as a row neighbour.
ROWS = Instance("chain", "chain\n;ab=C;cd=D;ef=F;gh=E\n;C=XY;E=GH;D=KL;F=MN\nfollow;ef=", "F=MN")


@pytest.mark.parametrize("given, relation", [
    ("KL", "next row in the hub table"),
    ("GH", "hub of a neighbouring link"),
    ("XY", "another hub"),
])
def test_another_hubs_value_is_placed_by_the_hub_it_read(given, relation):
    bench = _benchmark()
    assert bench.classify(ROWS, f"F={given}")[0] == "right hub, another hub's value"
    found, chance = bench.other_hub_relation(ROWS, given)
    assert found == relation
    assert chance == pytest.approx({"next row in the hub table": 1 / 3, "hub of a neighbouring link": 1 / 3,
                                    "another hub": 1 / 3})


def test_the_relations_of_wrong_values_are_tallied_beside_their_chance():
    bench = _benchmark()
    rng = random.Random(1)
    items, texts = [], []
    while len(items) < 20:  # each answered with the value of the row after its hub's
        item = ALL_TASKS["chain"].sample(rng, TEST)
        links, hubs, query = bench.parse(item.prompt)
        rows = list(hubs)
        row = rows.index(dict(links)[query])
        if row + 1 < len(rows) and hubs[rows[row + 1]] != hubs[rows[row]]:
            items.append(item)
            texts.append(f"{rows[row]}={hubs[rows[row + 1]]}")
    result = bench.tally(items, texts)
    assert result["classes"]["right hub, another hub's value"] == 20
    assert result["another_hubs_value_read_from"]["next row in the hub table"] == 20
    by_chance = result["another_hubs_value_read_from_by_chance"]
    assert 0 < by_chance["next row in the hub table"] < 20
    assert sum(by_chance.values()) == pytest.approx(20, abs=0.05)
    assert f"| next row in the hub table | 20 | {by_chance['next row in the hub table']} |" in bench.table(result)


def test_the_hub_given_run_counts_answers_it_fixes_and_breaks():
    bench = _benchmark()
    plain = ["C=XY", "C=GH", "E=GH", "C=XY"]
    given = ["C=XY", "C=XY", "C=XY", "C=GH"]
    assert bench.compare_hub_given([INSTANCE] * 4, plain, given) == {"correct": 3, "fixed": 2, "broken": 1}
    result = {**bench.tally([], []), "n": 4, "hub_given": {"correct": 3, "fixed": 2, "broken": 1}}
    result["classes"]["correct"] = 2
    assert "With the right hub written first: 3 of 4 correct; 2 of the 2 wrong answers above" in bench.table(result)
