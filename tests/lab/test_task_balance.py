"""training/task_balance.py: every task of a multi-task run gets the same typical
gradient scale, and the trainer applies, logs and resumes it."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.llada2_tiny import SIZES
from lab import train
from lab.training.task_balance import TaskGradientBalance


def test_tasks_with_small_gradients_are_scaled_up_to_the_mean():
    balance = TaskGradientBalance(decay=0.0)  # no memory: each task's latest norm
    assert balance.scale("copy", 0.4) == pytest.approx(1.0)  # alone, it is the mean
    assert balance.scale("retrieval", 0.1) == pytest.approx(0.25 / 0.1)
    assert balance.scale("copy", 0.4) == pytest.approx(0.25 / 0.4)
    assert 0.1 * balance.scale("retrieval", 0.1) == pytest.approx(0.4 * balance.scale("copy", 0.4))


def test_running_norms_smooth_and_survive_a_resume():
    balance = TaskGradientBalance(decay=0.5)
    balance.scale("a", 1.0)
    balance.scale("b", 3.0)
    balance.scale("a", 3.0)  # a's running norm: 0.5 * 1 + 0.5 * 3 = 2
    assert balance.norms == {"a": 2.0, "b": 3.0}
    resumed = TaskGradientBalance(decay=0.5)
    resumed.load_state_dict(balance.state_dict())
    assert resumed.scale("b", 3.0) == balance.scale("b", 3.0) == pytest.approx(2.5 / 3.0)


def test_a_broken_step_is_not_recorded():
    balance = TaskGradientBalance()
    balance.scale("a", 2.0)
    for norm in (math.inf, math.nan, 0.0):
        assert balance.scale("a", norm) == 1.0
    assert balance.norms == {"a": 2.0}
    with pytest.raises(ValueError):
        TaskGradientBalance(decay=1.0)


def test_the_trainer_balances_logs_and_resumes(tmp_path):
    out = tmp_path / "run"
    common = ["--arch", "llada2", "--out", str(out), *SIZES, "--tasks", "addition,brackets", "--warmup", "1",
              "--eval-n", "1", "--eval-every", "1000", "--save-every", "3", "--checkpoint-dtype", "float32",
              "--balance-tasks"]
    assert train.main([*common, "--steps", "6"]) == 0
    assert train.main([*common, "--steps", "8", "--resume"]) == 0
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(1, 9))
    assert all(r["grad_scale"] > 0 for r in log) and log[0]["grad_scale"] == 1.0  # the first task is the mean
    assert log[6]["grad_scale"] != 1.0, "the resumed run starts from the saved running norms, not alone"
    state = torch.load(out / "state.pt", weights_only=False)
    assert set(state["task_balance"]["norms"]) == {"addition", "brackets"}
    with pytest.raises(SystemExit):  # the LLaDA-format loop does not take it
        train.main(["--out", str(tmp_path / "llada"), "--tasks", "addition", "--steps", "1", "--balance-tasks"])
