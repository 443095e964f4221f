"""benchmarks/serve_sweep.py's task workloads: `tasks` draws the four original tasks'
held-out prompts, `hard-tasks` the four multi-step ones, each in equal shares with its
task's canvas length."""

from __future__ import annotations

import collections
import json

from tests.conftest import benchmark_module
from lab.tasks import ALL_TASKS, HARD_TASKS, TASKS, TEST, _split_of

# Each task's prompt opens with its own word (lab/tasks.py's formats).
OPENING_WORD = {"lookup": "retrieval", "add": "addition", "copy": "copy", "reverse": "reverse",
                "sort": "sort", "mul": "multiply", "chain": "chain", "close": "brackets"}


def _task_of(prompt: str) -> str:
    return OPENING_WORD[prompt.split()[0]]


def test_each_task_workload_draws_its_own_group_evenly_from_the_test_split(tmp_path):
    sweep = benchmark_module("serve_sweep")
    for workload, group in (("tasks", TASKS), ("hard-tasks", HARD_TASKS)):
        args = type("Args", (), {"out": tmp_path, "num_prompts": 16})()
        flags = sweep.dataset_args(workload, args)
        path = flags[flags.index("--dataset-path") + 1]
        lines = [json.loads(line) for line in open(path)]
        assert len(lines) == 16
        counts = collections.Counter(_task_of(line["prompt"]) for line in lines)
        assert counts == {name: 4 for name in group}
        for line in lines:
            task = ALL_TASKS[_task_of(line["prompt"])]
            assert line["output_tokens"] == task.gen_length
            assert _split_of(line["prompt"]) == TEST
