"""The training script writes an unmodified LLaDA checkpoint, logs its loss, and
resumes from its saved state."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from tests import oracle
from vllm_dllm.tasks import TASKS
from vllm_dllm.tools import train
from vllm_dllm.training.curriculum import Curriculum, task_at


def test_train_writes_checkpoint_and_resumes(tmp_path):
    out = tmp_path / "run"
    common = ["--out", str(out), "--hidden", "64", "--layers", "1", "--heads", "1", "--intermediate", "96",
              "--tasks", "addition,copy", "--eval-every", "1000", "--save-every", "2", "--threads", "1",
              "--rope-theta", "10000"]
    assert train.main([*common, "--steps", "3"]) == 0
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3] and all(r["loss"] > 0 for r in log)

    assert train.main([*common, "--steps", "5", "--resume"]) == 0
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log][3:] == [4, 5]  # resumed after step 3, not from scratch

    model_dir = out / "model"
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LLaDAModelLM"] and config["d_model"] == 64
    assert config["rope_theta"] == 10000.0  # the positions the model was trained with
    assert json.loads((model_dir / "generation_config.json").read_text())["max_new_tokens"] == 56
    generation = json.loads((model_dir / "generation_config.json").read_text())
    eot, eos = generation["eos_token_id"]
    model = oracle.load_oracle(str(model_dir))
    result = oracle.llada_generate(
        model, [10, 20, 30], gen_length=8, steps=8, block_length=8,
        mask_id=config["mask_token_id"], eos_id=eos, eot_id=eot,
    )
    assert len(result.tokens) == 8

    exported = tmp_path / "exported"
    # The saved run's shape and tasks win over the command line's.
    assert train.main(["--out", str(out), "--hidden", "256", "--tasks", "retrieval", "--export", str(exported)]) == 0
    for name in ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json"):
        assert (exported / name).read_bytes() == (model_dir / name).read_bytes(), name


class _UniformModel(torch.nn.Module):
    """Predicts every token with equal probability and records what it was shown."""

    def __init__(self, hidden: int, vocab: int):
        super().__init__()
        self.head = torch.nn.Linear(hidden, vocab, bias=False)
        torch.nn.init.zeros_(self.head.weight)
        self.hidden_size, self.seen = hidden, None

    def hidden_states(self, ids, lengths):
        self.seen = ids.clone()
        return torch.ones(*ids.shape, self.hidden_size)

    def logits(self, hidden):
        return self.head(hidden)


def _batch(rows: int, prompt_len: int, gen_length: int):
    prompts = [[5 + (i + j) % 7 for j in range(prompt_len + i % 3)] for i in range(rows)]
    canvases = [[20 + (i * j) % 9 for j in range(gen_length)] for i in range(rows)]
    return train.pack(prompts, canvases, pad=0)


def test_loss_weights_masked_tokens_by_inverse_mask_ratio():
    # With uniform predictions every masked token costs ln(V); weighting k masked tokens
    # by G/k and averaging over G makes every row cost exactly ln(V), whatever k is.
    vocab, gen_length, mask_id = 50, 8, 49
    model = _UniformModel(4, vocab)
    ids, lengths, starts = _batch(32, 6, gen_length)
    loss, accuracy = train.diffusion_loss(
        model, ids, lengths, starts, gen_length, mask_id, torch.Generator().manual_seed(0)
    )
    assert loss.item() == pytest.approx(math.log(vocab), rel=1e-5)
    assert 0.0 <= accuracy <= 1.0


def test_loss_masks_only_the_canvas_and_at_least_one_position_per_row():
    gen_length, mask_id = 8, 49
    model = _UniformModel(4, 50)
    ids, lengths, starts = _batch(64, 6, gen_length)
    train.diffusion_loss(model, ids, lengths, starts, gen_length, mask_id, torch.Generator().manual_seed(1))
    masked = model.seen == mask_id
    counts = []
    for row in range(ids.shape[0]):
        canvas = slice(int(starts[row]), int(starts[row]) + gen_length)
        assert not masked[row, : int(starts[row])].any(), "the prompt stays clean"
        assert not masked[row, int(starts[row]) + gen_length:].any(), "padding stays clean"
        counts.append(int(masked[row, canvas].sum()))
    assert min(counts) >= 1 and max(counts) <= gen_length
    # Stratified mask ratios cover the whole range in one batch.
    assert set(counts) == set(range(1, gen_length + 1))


def test_curriculum_grows_task_sizes_to_the_full_range():
    rng = random.Random(0)
    start = task_at("retrieval", 0.0)
    assert all(p.count(";") - 1 == 2 for p in (start.draw(rng).prompt for _ in range(50)))
    full = task_at("retrieval", 1.0)
    assert (full.min_pairs, full.max_pairs) == (TASKS["retrieval"].min_pairs, TASKS["retrieval"].max_pairs)
    copy_start, copy_full = task_at("reverse", 0.0), task_at("reverse", 2.0)
    assert copy_start.max_len == 8 and copy_full.max_len == TASKS["reverse"].max_len
    inst = copy_start.draw(rng)
    assert inst.answer == inst.prompt.split()[1][::-1], "the curriculum keeps the task's transform"
    assert task_at("addition", 0.5).max_digits < TASKS["addition"].max_digits


def test_adaptive_curriculum_raises_a_task_only_when_it_is_learned():
    cur = Curriculum(["copy", "retrieval"], threshold=0.9, increment=0.25, smoothing=0.5)
    assert cur.task("copy", 0).max_len == 8 and cur.level("retrieval", 10_000) == 0.0
    for _ in range(20):
        cur.observe("retrieval", 0.5)  # never good enough: stays small
    raised = [cur.observe("copy", 1.0) for _ in range(4)]
    assert raised == [False, False, False, True] and cur.levels["copy"] == 0.25
    assert cur.levels["retrieval"] == 0.0
    for _ in range(40):
        cur.observe("copy", 1.0)
    assert cur.levels["copy"] == 1.0 and cur.task("copy", 0).max_len == TASKS["copy"].max_len
    restored = Curriculum(["copy", "retrieval"], threshold=0.9, increment=0.25, smoothing=0.5)
    restored.load_state_dict(cur.state_dict())
    assert restored.levels == cur.levels and restored.running == cur.running
    with pytest.raises(ValueError, match="curriculum"):
        Curriculum(["copy", "retrieval"]).load_state_dict(cur.state_dict())


def test_linear_curriculum_and_no_curriculum():
    assert Curriculum(["copy"], linear_steps=100).level("copy", 50) == 0.5
    assert Curriculum(["copy"]).task("copy", 0).min_len == TASKS["copy"].min_len
    with pytest.raises(ValueError):
        Curriculum(["copy"], linear_steps=10, threshold=0.9)


def test_resume_keeps_the_adaptive_curriculum_and_refuses_another(tmp_path):
    out = tmp_path / "run"
    common = ["--out", str(out), "--hidden", "64", "--layers", "1", "--heads", "1", "--intermediate", "96",
              "--tasks", "addition", "--eval-every", "1000", "--save-every", "1", "--threads", "1"]
    assert train.main([*common, "--steps", "3", "--curriculum-threshold", "0.9"]) == 0
    state = torch.load(out / "state.pt", weights_only=False)
    assert state["curriculum"]["levels"] == {"addition": 0.0}
    state["curriculum"]["levels"]["addition"] = 0.5  # as if earned
    torch.save(state, out / "state.pt")
    assert train.main([*common, "--steps", "4", "--resume", "--curriculum-threshold", "0.9"]) == 0
    resumed = torch.load(out / "state.pt", weights_only=False)["curriculum"]["levels"]
    assert resumed["addition"] >= 0.5, "the earned level survives the resume"
    with pytest.raises(SystemExit):  # resumed without the curriculum it was trained with
        train.main([*common, "--steps", "5", "--resume"])


def test_task_weights_and_batch_sizes_shape_the_steps(tmp_path):
    names = ["retrieval", "addition", "copy"]
    cycle = train.task_cycle(names, train.parse_task_values("retrieval=3,copy=2", names, "--task-weights"))
    assert cycle == ["retrieval", "addition", "copy", "retrieval", "copy", "retrieval"]
    for bad in ("retrieval", "reverse=2", "copy=x", "copy=0"):
        with pytest.raises(ValueError, match="--task-weights"):
            train.parse_task_values(bad, names, "--task-weights")

    out = tmp_path / "run"
    common = ["--out", str(out), "--hidden", "64", "--layers", "1", "--heads", "1", "--intermediate", "96",
              "--tasks", "addition,copy", "--eval-every", "1000", "--save-every", "100", "--threads", "1"]
    assert train.main([*common, "--steps", "4", "--task-weights", "copy=3"]) == 0
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["task"] for r in log] == ["addition", "copy", "copy", "copy"]
    with pytest.raises(SystemExit):
        train.main([*common, "--steps", "1", "--batch-sizes", "copy=1"])


def test_init_from_starts_a_new_run_from_another_runs_weights_and_levels(tmp_path):
    shape = ["--hidden", "64", "--layers", "1", "--heads", "1", "--intermediate", "96", "--threads", "1",
             "--tasks", "addition,copy", "--eval-every", "1000", "--save-every", "100"]
    first, second = tmp_path / "first", tmp_path / "second"
    assert train.main(["--out", str(first), *shape, "--steps", "2", "--curriculum-threshold", "0.9"]) == 0
    state = torch.load(first / "state.pt", weights_only=False)
    state["curriculum"]["levels"]["copy"] = 0.7  # as if earned
    torch.save(state, first / "state.pt")

    # Zero steps: the new run's state is exactly what it started from.
    assert train.main(["--out", str(second), *shape, "--steps", "0", "--curriculum-threshold", "0.9",
                       "--init-from", str(first / "state.pt")]) == 0
    started = torch.load(second / "state.pt", weights_only=False)
    assert started["step"] == 0
    for name, weight in state["model"].items():
        assert torch.equal(started["model"][name], weight), name
    assert started["curriculum"]["levels"] == {"addition": 0.0, "copy": 0.7}

    with pytest.raises(SystemExit):  # another shape cannot take these weights
        train.main(["--out", str(tmp_path / "third"), *shape, "--hidden", "128", "--steps", "0",
                    "--init-from", str(first / "state.pt")])
    with pytest.raises(SystemExit):
        train.main(["--out", str(second), *shape, "--steps", "1", "--resume",
                    "--init-from", str(first / "state.pt")])
