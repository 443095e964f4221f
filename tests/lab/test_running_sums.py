"""Multiply's running-sum objective (training/running_sums.py): the column sums a probe
regresses, their place on the canvas, the term in the block-diffusion loss, and the
trainer's option around it."""

from __future__ import annotations

import json
import random

import pytest
import torch

from tests.llada2_tiny import SIZES, canvas_rows, tiny_model
from lab.tasks import ALL_TASKS, TRAIN, Instance, multiply_factors
from lab import train
from lab.train_llada2 import make_running_sum
from lab.training import llada2_objective
from lab.training.run_state import load_state
from lab.training.running_sums import TARGET_SCALE, RunningSumTerm, column_sums, running_sum_targets


def _partial_sum_through(a: int, b: int, k: int) -> int:
    """Every partial product a_i b_j 10^(i+j) with i + j <= k, summed."""
    da, db = str(a)[::-1], str(b)[::-1]
    return sum(int(x) * int(y) * 10 ** (i + j) for i, x in enumerate(da) for j, y in enumerate(db) if i + j <= k)


def test_column_sums_are_each_columns_partial_products_with_carry():
    assert column_sums(99, 99) == [9, 98, 170, 81]  # 9801: 81 -> 1 carry 8; 81+81+8 -> 0 carry 17; ...
    assert column_sums(4821, 97) == [4, 46, 107, 76, 23, 7]
    assert column_sums(0, 7) == [0] and column_sums(1000, 0) == [0]
    rng = random.Random(0)
    for _ in range(2000):
        a, b = rng.randrange(10 ** rng.randint(1, 4)), rng.randrange(10 ** rng.randint(1, 2))
        sums, product = column_sums(a, b), str(a * b)
        assert len(sums) == len(product)
        for p, (total, digit) in enumerate(zip(sums, product)):
            k = len(product) - 1 - p
            assert total % 10 == int(digit)
            # The running sum is everything at or below its column, in its column's units.
            assert total == _partial_sum_through(a, b, k) // 10**k
    with pytest.raises(ValueError, match="non-negative"):
        column_sums(-3, 4)


def test_targets_sit_on_multiply_rows_product_digits_only():
    instances = [Instance("multiply", "mul 4821*97=", "33747+433890=467637"), Instance("addition", "add 12+30=", "42"),
                 Instance("multiply", "mul 7*8=", "56"), Instance("multiply", "mul 4821*97=", "467637")]
    targets = running_sum_targets(instances, 20)
    assert targets.shape == (4, 20)
    # The product ends the answer: after the written working, or alone.
    assert targets[0, 13:19].tolist() == pytest.approx([TARGET_SCALE * s for s in column_sums(4821, 97)])
    assert targets[3, :6].tolist() == pytest.approx([TARGET_SCALE * s for s in column_sums(4821, 97)])
    assert targets[2, :2].tolist() == pytest.approx([TARGET_SCALE * 5, TARGET_SCALE * 56])
    assert torch.isnan(targets[0, :13]).all() and torch.isnan(targets[0, 19:]).all()
    assert torch.isnan(targets[1]).all() and torch.isnan(targets[2, 2:]).all() and torch.isnan(targets[3, 6:]).all()
    assert multiply_factors("sort 3 1 2") is None
    with pytest.raises(ValueError, match="past a canvas of 12"):
        running_sum_targets(instances[:1], 12)
    with pytest.raises(ValueError, match="does not end with the product"):
        running_sum_targets([Instance("multiply", "mul 4821*97=", "33747+433890=46763")], 20)
    rng = random.Random(1)
    for _ in range(50):  # the task's own prompts parse
        inst = ALL_TASKS["multiply"].sample(rng, TRAIN)
        a, b = multiply_factors(inst.prompt)
        assert inst.answer.endswith(str(a * b))


def test_the_tapped_stream_is_the_named_layers_output():
    model = tiny_model()
    ids = torch.randint(0, 2000, (2, 9))
    positions = torch.arange(9).expand(2, 9)
    mask = torch.ones(2, 9, 9, dtype=torch.bool)
    final, tapped = model.hidden_states_and_tap(ids, positions, mask, None, tap=1)
    x = model.model.word_embeddings(ids)
    valid = torch.ones_like(ids, dtype=torch.bool)
    for layer in model.model.layers[:2]:
        x = layer(x, positions, mask, valid)
    assert torch.equal(tapped, x)
    assert torch.equal(final, model.hidden_states(ids, positions, mask))
    with pytest.raises(ValueError, match="no layer 3"):
        model.hidden_states_and_tap(ids, positions, mask, None, tap=3)


BLOCK = 8
ANSWER_STAND_INS = {**{str(d): d + 10 for d in range(10)}, "+": 20, "=": 21}


def _batch(rng: random.Random, n: int, task: str):
    """Prompts, canvases holding `task`'s answers as digit stand-ins, and the targets."""
    prompts, canvases = canvas_rows(rng, n, BLOCK)
    instances = []
    for i in range(n):
        inst = ALL_TASKS[task].sample(rng, TRAIN)
        answer = [ANSWER_STAND_INS[ch] for ch in inst.answer] if task == "multiply" else []
        canvases[i] = llada2_objective.extend_to_block(answer + [7], len(prompts[i]), BLOCK, 7)
        instances.append(inst)
    return prompts, canvases, running_sum_targets(instances, max(map(len, canvases)))


def _loss(model, batch, running_sum, **options):
    prompts, canvases, _ = batch
    return llada2_objective.block_diffusion_loss(model, prompts, canvases, BLOCK, 2289,
                                                 torch.Generator().manual_seed(0), pad_id=7,
                                                 running_sum=running_sum, **options)


def test_the_term_adds_the_probes_weighted_error_to_the_loss():
    model = tiny_model().train()
    batch = _batch(random.Random(3), 12, "multiply")
    targets = batch[2]
    term = RunningSumTerm(64, 1, 0.5)
    torch.nn.init.normal_(term.probe.linear.weight, std=0.3)
    plain, plain_stats = _loss(model, batch, None, edit_ratio=0.1)
    joint, stats = _loss(model, batch, (term, targets), edit_ratio=0.1)
    assert "running_sum_mse" not in plain_stats and stats["running_sum_mse"] > 0
    assert joint.item() == pytest.approx(plain.item() + 0.5 * stats["running_sum_mse"], rel=1e-5)
    assert stats["answer_accuracy"] == plain_stats["answer_accuracy"], "the same masking either way"

    # Another task's batch has no target: the loss is the plain one.
    other = _batch(random.Random(4), 12, "addition")
    alone, _ = _loss(model, other, None)
    joint, stats = _loss(model, other, (term, other[2]))
    assert stats["running_sum_mse"] is None and joint.item() == pytest.approx(alone.item(), rel=1e-6)
    with pytest.raises(ValueError, match="running-sum targets of shape"):
        _loss(model, batch, (term, targets[:, :3]))


def test_the_probes_gradient_reaches_the_tapped_layer_and_none_past_it():
    model = tiny_model().train()
    ids = torch.randint(0, 2000, (3, 8))
    positions = torch.arange(8).expand(3, 8)
    mask = torch.ones(3, 8, 8, dtype=torch.bool)
    term = RunningSumTerm(64, 1, 1.0)
    torch.nn.init.normal_(term.probe.linear.weight, std=0.3)
    _, tapped = model.hidden_states_and_tap(ids, positions, mask, None, tap=1)
    term.loss(tapped.reshape(-1, 64), torch.rand(24) * 10).backward()
    assert term.probe.linear.weight.grad.abs().sum() > 0
    assert model.model.layers[1].attention.query_key_value.weight.grad.abs().sum() > 0
    assert all(p.grad is None for p in model.model.layers[2].parameters()) and model.lm_head.weight.grad is None


def test_a_fresh_probe_leaves_the_models_gradient_alone():
    """Zero weights: until the probe has found a direction, the term moves only the probe."""
    model = tiny_model().train()
    batch = _batch(random.Random(5), 12, "multiply")
    term = RunningSumTerm(64, 1, 1.0)
    grads = []
    for running_sum in (None, (term, batch[2])):
        model.zero_grad()
        loss, stats = _loss(model, batch, running_sum)
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    assert stats["running_sum_mse"] > 0 and term.probe.linear.bias.grad.abs().sum() > 0, "the term was there"
    assert len(grads[0]) == len(grads[1])
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(*grads))


def test_the_option_trains_saves_and_resumes_the_probe(tmp_path):
    out = tmp_path / "r"
    common = ["--arch", "llada2", "--out", str(out), *SIZES, "--tasks", "addition,multiply", "--lr", "3e-3",
              "--warmup", "1", "--eval-every", "1000", "--save-every", "2", "--checkpoint-dtype", "float32",
              "--running-sum-weight", "0.1"]
    assert train.main([*common, "--steps", "6"]) == 0
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    errors = {r["task"]: r["running_sum_mse"] for r in log}
    assert errors["addition"] is None and errors["multiply"] > 0
    saved = load_state(out / "state.pt")["running_sum"]
    assert saved["layer"] == 1 and saved["probe"]["linear.weight"].abs().sum() > 0  # three quarters of 3 layers
    assert train.main([*common, "--steps", "8", "--resume"]) == 0
    resumed = load_state(out / "state.pt")["running_sum"]
    assert resumed["optim"]["state"][0]["step"] > saved["optim"]["state"][0]["step"]
    with pytest.raises(SystemExit):  # the saved probe reads another layer
        train.main([*common, "--steps", "9", "--resume", "--running-sum-layer", "0"])


@pytest.mark.parametrize("extra", [
    ["--tasks", "addition", "--running-sum-weight", "0.1"],
    ["--tasks", "multiply", "--running-sum-weight", "0.1", "--running-sum-layer", "3"],
    ["--tasks", "multiply", "--running-sum-weight", "-1"],
    ["--tasks", "multiply", "--running-sum-layer", "1"],
])
def test_bad_running_sum_options_are_refused_before_training(tmp_path, extra):
    out = tmp_path / "r"
    with pytest.raises(SystemExit):
        train.main(["--arch", "llada2", "--out", str(out), *SIZES, "--steps", "2", "--save-every", "1", *extra])
    assert not (out / "state.pt").exists()


def test_the_llada_format_loop_refuses_the_option(tmp_path):
    with pytest.raises(SystemExit):
        train.main(["--out", str(tmp_path / "l"), "--steps", "1", "--running-sum-weight", "0.1"])
    assert not (tmp_path / "l" / "state.pt").exists()


class _Encoder:
    """Writes text a character a token, or with "12" as one token when `merge`."""

    def __init__(self, merge: bool):
        self.merge = merge

    def canvas(self, answer: str, gen_length: int) -> list[str]:
        tokens = answer.replace("12", "#") if self.merge else answer
        return list(tokens) + ["<eos>"] * (gen_length - len(tokens))

    def decode(self, tokens: list[str]) -> str:
        return "".join(t.replace("#", "12").replace("<eos>", "") for t in tokens)


def test_the_probes_default_layer_and_its_tokenizer_check():
    import argparse

    class Refused(Exception):
        pass

    class Parser:
        def error(self, message):
            raise Refused(message)

    def args(layers):
        return argparse.Namespace(running_sum_weight=0.1, running_sum_layer=None, layers=layers, hidden=8,
                                  device="cpu")

    assert make_running_sum(args(8), ["multiply"], _Encoder(False), Parser()).layer == 5
    assert make_running_sum(args(1), ["multiply"], _Encoder(False), Parser()).layer == 0
    with pytest.raises(Refused, match="each digit as its own token"):
        make_running_sum(args(8), ["multiply"], _Encoder(True), Parser())
