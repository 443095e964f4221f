"""The training script writes an unmodified LLaDA checkpoint, logs its loss, and
resumes from its saved state."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from tests import oracle, oracle_model
from lab.tasks import HARD_TASKS, TASKS
from lab import train
from lab.training import batches, llada_objective, schedule
from lab.training.curriculum import Curriculum, Draw, hard_part, task_at


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
    model = oracle_model.load_oracle(str(model_dir))
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
    return batches.pack(prompts, canvases, pad=0)


def test_loss_weights_masked_tokens_by_inverse_mask_ratio():
    # With uniform predictions every masked token costs ln(V); weighting k masked tokens
    # by G/k and averaging over G makes every row cost exactly ln(V), whatever k is.
    vocab, gen_length, mask_id = 50, 8, 49
    model = _UniformModel(4, vocab)
    ids, lengths, starts = _batch(32, 6, gen_length)
    loss, accuracy = llada_objective.diffusion_loss(
        model, ids, lengths, starts, gen_length, mask_id, torch.Generator().manual_seed(0)
    )
    assert loss.item() == pytest.approx(math.log(vocab), rel=1e-5)
    assert 0.0 <= accuracy <= 1.0


def test_loss_masks_only_the_canvas_and_at_least_one_position_per_row():
    gen_length, mask_id = 8, 49
    model = _UniformModel(4, 50)
    ids, lengths, starts = _batch(64, 6, gen_length)
    llada_objective.diffusion_loss(model, ids, lengths, starts, gen_length, mask_id, torch.Generator().manual_seed(1))
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
    cur = Curriculum(["copy", "retrieval"], threshold=0.9, increment=0.25, min_observations=4)
    assert cur.task("copy", 0).max_len == 8 and cur.level("retrieval", 10_000) == 0.0
    for _ in range(50):
        cur.observe("retrieval", 0.85)  # never good enough: stays small
    raised = [cur.observe("copy", 1.0) for _ in range(4)]
    # Right from its first batches: raised after min_observations, not after the ~22
    # batches an average started at zero needs to pass 0.9 at smoothing 0.9.
    assert raised == [False, False, False, True] and cur.levels["copy"] == 0.25
    assert cur.levels["retrieval"] == 0.0
    # Each level is earned anew: a bad batch early at the new sizes weighs in.
    assert [cur.observe("copy", a) for a in (0.2, 1.0, 1.0, 1.0)] == [False] * 4
    for _ in range(40):
        cur.observe("copy", 1.0)
    assert cur.levels["copy"] == 1.0 and cur.task("copy", 0).max_len == TASKS["copy"].max_len
    restored = Curriculum(["copy", "retrieval"], threshold=0.9, increment=0.25)
    restored.load_state_dict(cur.state_dict())
    assert restored.levels == cur.levels and restored.running == cur.running and restored.seen == cur.seen
    with pytest.raises(ValueError, match="curriculum"):
        Curriculum(["copy", "retrieval"]).load_state_dict(cur.state_dict())


def test_curriculum_reads_a_state_saved_before_counts_as_an_uncorrected_average():
    legacy = {"settings": {"linear_steps": 0, "threshold": 0.9, "increment": 0.1},
              "levels": {"copy": 0.3}, "running": {"copy": 0.89}}
    cur = Curriculum(["copy"], threshold=0.9)
    cur.load_state_dict(legacy)
    assert cur.estimate("copy") == pytest.approx(0.89)
    # The run goes on where it stood: 0.9 * 0.89 + 0.1 passes at once.
    assert cur.observe("copy", 1.0) and cur.levels["copy"] == 0.4
    assert cur.seen["copy"] == 0 and not cur.observe("copy", 1.0)
def test_full_size_share_trains_some_batches_at_the_full_range_without_earning_levels():
    cur = Curriculum(["multiply", "copy"], threshold=0.9, full_share=0.25)
    cur.levels["copy"] = 1.0
    rng = random.Random(0)
    draws = [cur.draw("multiply", 0, rng) for _ in range(400)]
    full = [d.task for d in draws if d.full_size]
    assert 60 <= len(full) <= 140, len(full)  # 100 expected; +-4 standard deviations
    assert all((t.max_digits_a, t.max_digits_b) == (HARD_TASKS["multiply"].max_digits_a, HARD_TASKS["multiply"].max_digits_b)
               for t in full)
    assert all(d.task.max_digits_a == 1 for d in draws if d.at_level), "the rest stay at the level's sizes"
    # A task at its full sizes, or a curriculum without a share, leaves the data stream alone.
    before = rng.getstate()
    assert all(cur.draw("copy", 0, rng).at_level for _ in range(20))
    plain = Curriculum(["multiply"], threshold=0.9)
    assert all(plain.draw("multiply", 0, rng).at_level for _ in range(20))
    assert rng.getstate() == before
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="full-size share"):
            Curriculum(["copy"], threshold=0.9, full_share=bad)


def test_a_per_task_full_size_share_draws_only_that_task_at_full_size():
    cur = Curriculum(["multiply", "chain"], threshold=0.9, full_share={"chain": 1.0})
    rng = random.Random(0)
    assert not any(cur.draw("chain", 0, rng).at_level for _ in range(20)), "chain at share 1: always full size"
    before = rng.getstate()
    assert all(cur.draw("multiply", 0, rng).at_level for _ in range(20)), "multiply has no share"
    assert rng.getstate() == before
    with pytest.raises(ValueError, match="not trained"):
        Curriculum(["copy"], threshold=0.9, full_share={"chain": 0.5})
    with pytest.raises(ValueError, match="full-size share"):
        Curriculum(["copy"], threshold=0.9, full_share={"copy": 1.5})


def test_full_size_share_flag_reads_one_share_then_per_task_ones():
    names = ["sort", "multiply", "chain"]
    flag = "--full-size-share"
    assert schedule.parse_shares("0", names, flag) == {"sort": 0.0, "multiply": 0.0, "chain": 0.0}
    assert schedule.parse_shares("0.5", names, flag) == {"sort": 0.5, "multiply": 0.5, "chain": 0.5}
    assert schedule.parse_shares("0.5,chain=1", names, flag) == {"sort": 0.5, "multiply": 0.5, "chain": 1.0}
    assert schedule.parse_shares("multiply=0.8", names, flag) == {"sort": 0.0, "multiply": 0.8, "chain": 0.0}
    for bad, why in (("copy=1", "names no trained task"), ("chain=x", "is not a number"), ("half", "is not a number")):
        with pytest.raises(ValueError, match=f"{flag}: .*{why}"):
            schedule.parse_shares(bad, names, flag)


def test_after_batch_feeds_only_batches_at_the_level():
    cur = Curriculum(["copy"], threshold=0.9)
    cur.min_observations = 2
    copy = task_at("copy", 0.0)
    assert cur.after_batch(Draw(copy, full_size=True), 1.0) == {"full_size": True} and cur.seen["copy"] == 0
    assert cur.after_batch(Draw(copy, focus=True), 1.0) == {"focus": True} and cur.seen["copy"] == 0
    assert cur.after_batch(Draw(copy), None) == {} and cur.seen["copy"] == 0
    assert cur.after_batch(Draw(copy), 1.0) == {} and cur.seen["copy"] == 1
    before = cur.levels["copy"]
    assert cur.after_batch(Draw(copy), 1.0) == {"level": cur.levels["copy"]} and cur.levels["copy"] > before


def _factor_digits(prompt: str) -> tuple[int, int]:
    a, b = prompt.removeprefix("mul ").removesuffix("=").split("*")
    return len(a), len(b)


def test_focus_share_trains_some_multiply_batches_on_two_multi_digit_factors():
    cur = Curriculum(["multiply", "copy"], threshold=0.9, focus_share={"multiply": 0.5})
    cur.levels["multiply"] = 1.0
    rng = random.Random(0)
    draws = [cur.draw("multiply", 0, rng) for _ in range(400)]
    focused = [d for d in draws if d.focus]
    assert 160 <= len(focused) <= 240, len(focused)  # 200 expected; +-4 standard deviations
    assert not any(d.at_level for d in focused) and all(d.at_level for d in draws if not d.focus)
    sizes = {_factor_digits(d.task.draw(rng).prompt) for d in focused for _ in range(5)}
    assert sizes <= {(a, 2) for a in (2, 3, 4)} and len(sizes) == 3, sizes
    # The rest draw the eval's range, one-digit factors included.
    plain = {_factor_digits(d.task.draw(rng).prompt) for d in draws if not d.focus for _ in range(5)}
    assert (1, 1) in plain and (4, 2) in plain
    # A task without a share leaves the data stream alone.
    before = rng.getstate()
    assert all(cur.draw("copy", 0, rng).at_level for _ in range(20)) and rng.getstate() == before
    # At one-digit multipliers a focused draw has nothing harder to give: an ordinary
    # batch that earns its level (the share still reads the stream, which stays stable).
    cur.levels["multiply"] = 0.0
    low = [cur.draw("multiply", 0, rng) for _ in range(20)]
    assert all(d.at_level and (d.task.max_digits_a, d.task.max_digits_b) == (1, 1) for d in low)
    assert rng.getstate() != before


def test_hard_parts_of_multiply_and_sort_and_tasks_without_one():
    rng = random.Random(0)
    long_sorts = [hard_part(HARD_TASKS["sort"]).draw(rng).prompt for _ in range(200)]
    assert {p.count(" ") for p in long_sorts} == set(range(7, 11)), "sort: the longer half of 4-10 numbers"
    # Below a two-digit multiplier, or at one list length, there is no harder part.
    assert hard_part(task_at("multiply", 0.0)) is None and hard_part(task_at("multiply", 0.3)) is None
    assert hard_part(task_at("sort", 0.0)) is not None and hard_part(type(HARD_TASKS["sort"])(5, 5)) is None
    assert hard_part(HARD_TASKS["chain"]) is None and hard_part(TASKS["copy"]) is None
    with pytest.raises(ValueError, match="'copy', which has no hard part"):
        Curriculum(["copy"], threshold=0.9, focus_share={"copy": 0.5})
    with pytest.raises(ValueError, match="focus share must be in"):
        Curriculum(["multiply"], threshold=0.9, focus_share=1.5)


def test_multiply_keeps_the_eval_instances_its_default_range_always_drew():
    rng, again = random.Random(7), random.Random(7)
    for _ in range(500):
        a = again.randrange(10 ** again.randint(1, 4))
        b = again.randrange(10 ** again.randint(1, 2))
        assert HARD_TASKS["multiply"].draw(rng).prompt == f"mul {a}*{b}="


def test_full_size_batches_are_logged_and_do_not_count_toward_a_level(tmp_path, capsys):
    out = tmp_path / "run"
    common = ["--out", str(out), "--hidden", "64", "--layers", "1", "--heads", "1", "--intermediate", "96",
              "--tasks", "addition", "--eval-every", "1000", "--save-every", "100", "--threads", "1",
              "--curriculum-threshold", "0.9"]
    assert train.main([*common, "--steps", "3", "--full-size-share", "1"]) == 0
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r.get("full_size") for r in log] == [True] * 3
    state = torch.load(out / "state.pt", weights_only=False)
    assert state["curriculum"]["seen"]["addition"] == 0 and state["curriculum"]["levels"]["addition"] == 0.0
    # A state saved without a share resumes with one: the share does not change what a level means.
    assert train.main([*common, "--steps", "4", "--resume"]) == 0
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert "full_size" not in log[-1]
    assert torch.load(out / "state.pt", weights_only=False)["curriculum"]["seen"]["addition"] == 1
    bad_shares = [("--full-size-share", "2", "must be in"), ("--full-size-share", "copy=0.5", "names no trained task"),
                  ("--focus-share", "addition=0.5", "'addition', which has no hard part"),
                  ("--focus-share", "multiply=0.5", "names no trained task"),
                  ("--focus-share", "2", "focus share must be in")]
    for flag, bad, why in bad_shares:
        capsys.readouterr()
        with pytest.raises(SystemExit, match="2"):
            train.main([*common, "--out", str(tmp_path / "bad"), "--steps", "1", flag, bad])
        error = capsys.readouterr().err
        assert why in error and flag in error, (flag, bad, error)


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
    cycle = schedule.task_cycle(names, schedule.parse_task_values("retrieval=3,copy=2", names, "--task-weights"))
    assert cycle == ["retrieval", "addition", "copy", "retrieval", "copy", "retrieval"]
    for bad in ("retrieval", "reverse=2", "copy=x", "copy=0"):
        with pytest.raises(ValueError, match="--task-weights"):
            schedule.parse_task_values(bad, names, "--task-weights")

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

    # --export-weights: the same start from a third of the file (no optimizer, no streams).
    assert train.main(["--out", str(first), *shape, "--export-weights", str(tmp_path / "w" / "weights.pt")]) == 0
    slim = torch.load(tmp_path / "w" / "weights.pt", weights_only=False)
    assert "optim" not in slim and "data_rng" not in slim and slim["step"] == 2
    assert train.main(["--out", str(tmp_path / "fourth"), *shape, "--steps", "0", "--curriculum-threshold", "0.9",
                       "--init-from", str(tmp_path / "w" / "weights.pt")]) == 0
    carried = torch.load(tmp_path / "fourth" / "state.pt", weights_only=False)
    assert carried["curriculum"]["levels"] == {"addition": 0.0, "copy": 0.7}
    for name, weight in state["model"].items():
        assert torch.equal(carried["model"][name], weight), name
    with pytest.raises(SystemExit, match="2"):  # no saved state to export
        train.main(["--out", str(tmp_path / "none"), *shape, "--export-weights", str(tmp_path / "x.pt")])

    with pytest.raises(SystemExit):  # another shape cannot take these weights
        train.main(["--out", str(tmp_path / "third"), *shape, "--hidden", "128", "--steps", "0",
                    "--init-from", str(first / "state.pt")])
    with pytest.raises(SystemExit):
        train.main(["--out", str(second), *shape, "--steps", "1", "--resume",
                    "--init-from", str(first / "state.pt")])


def test_loss_with_per_row_canvas_lengths_masks_each_row_inside_its_own_canvas():
    # Rows of canvas lengths 1..8 in one batch: each masks between 1 and its own G
    # positions, never past its canvas, and uniform predictions still cost ln(V) per row.
    vocab, mask_id, rows = 50, 49, 64
    gen_lengths = torch.tensor([1 + i % 8 for i in range(rows)])
    prompts = [[5 + (i + j) % 7 for j in range(6 + i % 3)] for i in range(rows)]
    canvases = [[20 + (i * j) % 9 for j in range(int(gen_lengths[i]))] for i in range(rows)]
    ids, lengths, starts = batches.pack(prompts, canvases, pad=0)
    model = _UniformModel(4, vocab)
    loss, _ = llada_objective.diffusion_loss(model, ids, lengths, starts, gen_lengths, mask_id, torch.Generator().manual_seed(2))
    assert loss.item() == pytest.approx(math.log(vocab), rel=1e-5)
    masked = model.seen == mask_id
    for row in range(rows):
        start, g = int(starts[row]), int(gen_lengths[row])
        assert not masked[row, :start].any() and not masked[row, start + g:].any()
        assert 1 <= int(masked[row, start:start + g].sum()) <= g
    # Every row's full range of mask counts is reachable: the longest rows see both ends.
    long_rows = [int(masked[r, int(starts[r]):].sum()) for r in range(rows) if gen_lengths[r] == 8]
    assert min(long_rows) < 4 < max(long_rows)


def test_rows_draw_canvas_lengths_from_the_answer_length_to_the_maximum(tmp_path):
    from lab.training.checkpoint import build_tokenizer

    ids = build_tokenizer(tmp_path, 512)
    encoder = batches.Encoder(tmp_path, ids)
    rng = random.Random(0)
    instances, _, canvases = batches.make_batch(TASKS["addition"], encoder, rng, 400, max_canvas=64, own_share=0.25)
    lengths = [len(c) for c in canvases]
    assert min(lengths) >= 1 and max(lengths) <= 64 and max(lengths) > 56
    assert 0.15 < sum(n == TASKS["addition"].gen_length for n in lengths) / len(lengths) < 0.4
    for inst, canvas in zip(instances, canvases):
        answer = encoder.tok.encode(inst.answer, add_special_tokens=False)
        assert len(canvas) >= len(answer) and canvas[: len(answer)] == answer
        rest = canvas[len(answer):]
        # The answer, then <|eot_id|> when there is room, then EOS padding to the end.
        assert rest == ([ids["eot"]] + [ids["eos"]] * (len(rest) - 1) if rest else [])
    # Without --max-canvas every canvas keeps the task's own length.
    _, _, canvases = batches.make_batch(TASKS["copy"], encoder, rng, 8)
    assert {len(c) for c in canvases} == {TASKS["copy"].gen_length}


def test_fitting_task_keeps_only_answers_that_fit_the_canvas():
    from lab.training.curriculum import fitting_task

    rng = random.Random(0)
    assert fitting_task(TASKS["copy"], 8) is None and fitting_task(TASKS["reverse"], 15) is None
    for name, canvas in [("copy", 16), ("reverse", 32), ("addition", 4), ("addition", 8), ("retrieval", 2)]:
        task = fitting_task(TASKS[name], canvas)
        answers = [task.draw(rng).answer for _ in range(300)]
        assert max(len(a) for a in answers) <= canvas, (name, canvas)
    assert fitting_task(TASKS["addition"], 8) is TASKS["addition"]  # 6-digit operands: sums of up to 7
    assert {len(fitting_task(TASKS["copy"], 16).draw(rng).answer) for _ in range(20)} == {16}
    # Multiply's written working needs 24 positions; below that, the one-digit multipliers.
    assert fitting_task(HARD_TASKS["multiply"], 24) is HARD_TASKS["multiply"]
    short = fitting_task(HARD_TASKS["multiply"], 8)
    assert max(len(short.draw(rng).answer) for _ in range(300)) < 8 and short.max_digits_b == 1
    assert fitting_task(HARD_TASKS["multiply"], 4) is None


def test_init_from_a_checkpoint_folder_loads_its_weights(tmp_path):
    from safetensors.torch import load_file

    shape = ["--hidden", "64", "--layers", "1", "--heads", "1", "--intermediate", "96", "--threads", "1",
             "--tasks", "addition,copy", "--eval-every", "1000", "--save-every", "100", "--rope-theta", "10000"]
    first, second = tmp_path / "first", tmp_path / "second"
    assert train.main(["--out", str(first), *shape, "--steps", "2", "--max-canvas", "24",
                       "--eval-every", "2", "--eval-n", "2", "--eval-lengths", "8,16"]) == 0
    last = json.loads((first / "train_log.jsonl").read_text().splitlines()[-1])
    # Copy's 16-48 symbols fit no 8-position canvas: evaluated at 16 only.
    assert set(last["accuracy_at_8"]) == {"addition"} and set(last["accuracy_at_16"]) == {"addition", "copy"}
    assert train.main(["--out", str(second), *shape, "--steps", "0", "--init-from", str(first / "model")]) == 0
    shipped = load_file(str(first / "model" / "model.safetensors"))
    started = torch.load(second / "state.pt", weights_only=False)["model"]
    for name, weight in shipped.items():
        assert torch.equal(started[name], weight.float()), name
    with pytest.raises(SystemExit):  # a folder without weights
        train.main(["--out", str(tmp_path / "third"), *shape, "--steps", "0", "--init-from", str(tmp_path)])
