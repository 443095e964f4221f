"""The shipped LLaDA2 task model (vllm_dllm/llada2_model): a LLaDA2 checkpoint that the
plugin serves and that answers the tasks it has learned.  The floors sit well under its
recorded accuracy (benchmarks/results/llada2-shipped/: copy 100%, retrieval 99.5%,
multiply 92% at n = 200) and far above chance, so an export that broke the weights, the
tokenizer or the chat frame fails, and numerics that differ by CPU do not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lab import eval as task_eval
from vllm_dllm.llada2_model import PATH
from lab.tasks import ALL_TASKS, TASK_GROUPS
from lab.training.run_state import CURRICULUM_FILE

# Right answers of 16 held-out instances.  multiply (90.5% over 600) is the task the
# padded working taught; a four-digit product is never right by chance.
FLOORS = {"copy": 14, "retrieval": 10, "multiply": 11}


@pytest.fixture(scope="module")
def runner():
    runner = task_eval.OfflineRunner(
        str(PATH),
        dict(max_model_len=512, max_num_seqs=16, kv_cache_memory_bytes=256 << 20,
             gpu_memory_utilization=0.3, enforce_eager=True, seed=0),
    )
    yield runner
    runner.engine.engine_core.shutdown()


def test_shipped_checkpoint_is_a_llada2_checkpoint_that_carries_its_run():
    config = json.loads((Path(PATH) / "config.json").read_text())
    assert config["architectures"] == ["LLaDA2MoeModelLM"] and config["model_type"] == "llada2_moe"
    assert (Path(PATH) / "model.safetensors").stat().st_size < 32 << 20
    levels = json.loads((Path(PATH) / CURRICULUM_FILE).read_text())["levels"]
    # Training-only tasks the run also learned (padded_sum) carry their levels too.
    assert set(TASK_GROUPS["every"]) <= set(levels)


@pytest.mark.parametrize("name", sorted(FLOORS))
def test_the_shipped_llada2_model_answers_what_it_has_learned(runner, name):
    assert not runner.exact, "a LLaDA2 checkpoint decodes with its own defaults"
    result = task_eval.evaluate_task(runner, ALL_TASKS[name], 16, 0, {})
    assert result.correct >= FLOORS[name], result
