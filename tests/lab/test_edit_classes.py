"""benchmarks/llada2_edits.py's classes of a token edit against the answer, and the
reference loop's edit trace it reads (tests/oracle_llada2.py)."""

from __future__ import annotations

import json
import random
from pathlib import Path

from tests.conftest import benchmark_module, random_prompt
from tests.oracle_llada2 import llada2_generate, load_llada2_oracle



def _benchmark():
    return benchmark_module("llada2_edits")


def test_an_edit_is_fixed_broke_or_wrong_to_wrong_against_the_answer():
    classify = _benchmark().classify
    target = [5, 6, 7, 2]
    edits = [(0, 9, 5), (1, 6, 8), (2, 8, 9), (3, 2, 4), (5, 1, 3)]  # the last lies past the answer's block
    assert classify(edits, target) == {"fixed": 1, "broke": 2, "wrong_to_wrong": 2}


def test_the_edit_trace_lists_every_edit_the_reference_makes(tiny_dirs):
    model_dir = tiny_dirs("llada2")
    ids = json.loads((Path(model_dir) / "generation_config.json").read_text())
    oracle = load_llada2_oracle(model_dir)
    rng = random.Random(3)
    traced = 0
    for _ in range(6):
        log: list = []
        result = llada2_generate(oracle, random_prompt(rng, 9), gen_length=16, mask_id=ids["mask_token_id"],
                                 eos_id=ids["eos_token_id"], block_length=8, threshold=0.5, editing_threshold=0.0,
                                 edit_log=log)
        assert len(log) == result.edits
        # Canvas positions up to the end of the last block (prompt 9 + 16 -> 32).
        assert all(before != after and 0 <= position < 32 - 9 for position, before, after in log)
        traced += len(log)
    assert traced > 0  # speed mode's threshold 0 edits a random model's tokens
