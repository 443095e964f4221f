"""lab/probes/llada2_padded_sum.py: the in-answer sum read in each layout, only the
sum's own digits scored."""

from __future__ import annotations

import importlib
import pathlib

from tests.llada2_tiny import SIZES
from lab import train


def test_layouts_and_only_the_sums_own_digits_are_scored():
    module = importlib.import_module("lab.probes.llada2_padded_sum")
    assert module.written(195, 1170, None) == ("195+1170=", "1365")
    assert module.written(195, 1170, 7) == ("0000195+0001170=", "0001365")
    # hits of "0001365": the zeros' hits never count, the units come first.
    assert module.sum_digits_from_units([False, False, False, True, False, True, True], 1365) == [True, True,
                                                                                                  False, True]
    assert module.sum_digits_from_units([True, False], 10) == [False, True]
    sets = module.pairs(20)
    assert set(sets) == {"working_sum test split", "4x2 partial products"}
    for x, y in sets["4x2 partial products"]:
        assert y % 10 == 0 and len(str(x)) <= 5 and len(str(y)) <= 6


def test_a_padded_sum_state_is_measured_in_both_layouts(tmp_path):
    out = tmp_path / "run"
    assert train.main(["--arch", "llada2", "--out", str(out), *SIZES, "--tasks", "padded_sum", "--steps", "1",
                       "--warmup", "1", "--eval-every", "1000", "--save-every", "1",
                       "--checkpoint-dtype", "float32"]) == 0
    module = importlib.import_module("lab.probes.llada2_padded_sum")
    sets = module.pairs(3)
    state = pathlib.Path(out / "state.pt")
    rows = []
    for width in (None, 7):
        result = module.measure(state, width, sets)
        rows.append({"state": str(state), **result})
        for name, items in sets.items():
            m = result[name]
            assert m["digits"] == sum(len(str(x + y)) for x, y in items), "leading zeros are not scored"
            assert 0 <= m["digit_accuracy"] <= 1 and 0 <= m["whole"] <= 3
    table = module.table({"n": 3, "sets": list(sets), "states": rows})
    assert "| unpadded |" in table and "| padded to 7 |" in table, "one state read in both layouts, two rows"
