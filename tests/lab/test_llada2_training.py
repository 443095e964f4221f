"""`train --arch llada2`: a LLaDA2.x-format task model trained with block diffusion and
token editing, written as an unmodified LLaDA2 checkpoint that the independent oracle
(tests/oracle_llada2.py) and the plugin's model class load; the trainer's options.
The objective itself (what a row's forward sees and scores): test_llada2_objective.py."""

from __future__ import annotations

import json
import random

import pytest
import torch

from tests.llada2_tiny import MOE, SHAPE, SIZES, CharEncoder, tiny_model
from tests.oracle_llada2 import block_causal_mask as oracle_mask
from tests.oracle_llada2 import llada2_generate, load_llada2_oracle
from lab.tasks import ALL_TASKS, TEST
from lab import train
from lab.training import llada2
from lab.training.batches import Llada2Encoder
from lab.training.run_state import CURRICULUM_FILE


@pytest.mark.parametrize("per_token, starved", [(2, None), (1, 3)])
def test_moe_output_and_gradients_are_the_routed_experts_weighted_sum(per_token, starved):
    """The grouped forward (pairs sorted by expert, permutations with gather
    backwards) against every expert evaluated on every token and masked by the
    routing weights, in float64 (the routing scores are float32 on both sides), so
    a difference is a bug rather than rounding.  `starved`: an expert no token picks."""
    torch.manual_seed(3)
    moe = llada2.MoE(SHAPE["hidden"], {**MOE, "experts_per_token": per_token})
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    moe.gate.expert_bias.normal_(0, 0.1)
    if starved is not None:
        moe.gate.expert_bias[starved] = -1e3
    moe = moe.double().train()

    def reference(x):
        chosen, weights = moe.route(x)
        dense = torch.zeros(len(x), MOE["num_experts"], dtype=torch.float64).scatter(1, chosen, weights.double())
        return sum(dense[:, e, None] * expert(x) for e, expert in enumerate(moe.experts)) + moe.shared_experts(x)

    def output_and_grads(forward, x):
        x = x.clone().requires_grad_()
        moe.zero_grad(set_to_none=True)
        out = forward(x)
        (out * upstream).sum().backward()
        return out, [x.grad] + [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in moe.parameters()]

    x = torch.randn(57, SHAPE["hidden"], dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    upstream = torch.randn(57, SHAPE["hidden"], dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    moe.load.zero_()
    got, got_grads = output_and_grads(moe, x)
    chosen = moe.route(x)[0]
    assert chosen.shape == (57, per_token)
    assert moe.load.equal(torch.bincount(chosen.flatten(), minlength=MOE["num_experts"]).to(moe.load.dtype))
    assert (starved is None) == bool(moe.load.all())
    want, want_grads = output_and_grads(reference, x)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert len(got_grads) == len(want_grads) > 3 * MOE["num_experts"]
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
    empty = torch.zeros(0, SHAPE["hidden"], dtype=torch.float64)
    assert moe(empty).shape == empty.shape  # every position padding: nothing routed


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("llada2-run")
    common = ["--arch", "llada2", "--out", str(out), *SIZES, "--tasks", "addition,multiply,brackets",
              "--lr", "3e-3", "--warmup", "5", "--eval-every", "1000", "--eval-n", "4", "--save-every", "20",
              "--checkpoint-dtype", "float32", "--edit-ratio", "0.2"]
    assert train.main([*common, "--steps", "40"]) == 0
    assert train.main([*common, "--steps", "45", "--resume", "--eval-every", "45"]) == 0
    return out


def test_training_lowers_the_loss_and_resumes(trained):
    log = [json.loads(line) for line in (trained / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(1, 46)), "resumed after step 40, not from scratch"
    losses = [r["loss"] for r in log]
    first, last = sum(losses[:6]) / 6, sum(losses[34:40]) / 6
    assert last < 0.6 * first, (first, last)
    assert log[-1]["edit_kept"] is not None and set(log[-1]["accuracy"]) == {"addition", "multiply", "brackets"}
    state = torch.load(trained / "state.pt", weights_only=False)
    biases = [v for k, v in state["model"].items() if k.endswith("expert_bias")]
    assert len(biases) == 2 and all(b.abs().sum() > 0 for b in biases), "balancing moved the expert biases"


def test_checkpoint_is_a_llada2_release_folder(trained):
    model_dir = trained / "model"
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LLaDA2MoeModelLM"] and config["model_type"] == "llada2_moe"
    assert (config["hidden_size"], config["num_key_value_heads"], config["num_experts"]) == (64, 2, 8)
    assert config["first_k_dense_replace"] == 1 and config["use_qk_norm"] and config["partial_rotary_factor"] == 0.5
    assert config["rope_theta"] == 10000.0 and config["vocab_size"] == 2304
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert generation["max_new_tokens"] == max(ALL_TASKS[n].gen_length for n in ("addition", "multiply", "brackets"))
    from safetensors.torch import load_file

    names = set(load_file(str(model_dir / "model.safetensors")))
    assert "model.layers.0.mlp.gate_proj.weight" in names and "model.layers.1.mlp.gate.expert_bias" in names
    assert "model.layers.2.mlp.experts.7.down_proj.weight" in names and "lm_head.weight" in names
    assert "model.layers.1.mlp.shared_experts.up_proj.weight" in names
    # --export writes the same folder from the saved state.
    exported = trained / "exported"
    assert train.main(["--out", str(trained), "--export", str(exported)]) == 0
    for name in ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json"):
        assert (exported / name).read_bytes() == (model_dir / name).read_bytes(), name


def test_a_run_starts_from_a_llada2_checkpoint_folder(trained, tmp_path):
    # What carries a run between machines when only git does: the exported folder.
    from safetensors.torch import load_file

    second = tmp_path / "second"
    assert train.main(["--arch", "llada2", "--out", str(second), *SIZES, "--tasks", "addition", "--steps", "0",
                       "--init-from", str(trained / "model")]) == 0
    exported = load_file(str(trained / "model" / "model.safetensors"))
    started = torch.load(second / "state.pt", weights_only=False)["model"]
    assert set(started) == set(exported)
    for name, weight in exported.items():
        assert torch.equal(started[name], weight.float()), name


@pytest.mark.parametrize("records_settings", [True, False], ids=["current-state", "state-without-settings"])
def test_an_exported_folder_carries_its_runs_curriculum_levels(trained, tmp_path, records_settings):
    import shutil

    from lab.training.curriculum import Curriculum

    adaptive = Curriculum(["addition", "multiply"], threshold=0.9)
    adaptive.levels.update(addition=0.3, multiply=0.6)
    state = torch.load(trained / "state.pt", weights_only=False)
    state["curriculum"] = adaptive.state_dict()
    if not records_settings:
        # States saved before curricula recorded their settings (all from adaptive runs).
        del state["curriculum"]["settings"]
    torch.save(state, tmp_path / "state.pt")
    shutil.copytree(trained / "tokenizer", tmp_path / "tokenizer")
    folder = tmp_path / "exported"
    assert train.main(["--out", str(tmp_path), "--export", str(folder)]) == 0
    saved = json.loads((folder / CURRICULUM_FILE).read_text())
    assert saved["levels"] == {"addition": 0.3, "multiply": 0.6}
    assert ("settings" in saved) == records_settings, "no settings are written as null"
    second = tmp_path / "second"
    assert train.main(["--arch", "llada2", "--out", str(second), *SIZES, "--tasks", "addition,brackets",
                       "--curriculum-threshold", "0.9", "--steps", "0", "--init-from", str(folder)]) == 0
    levels = torch.load(second / "state.pt", weights_only=False)["curriculum"]["levels"]
    assert levels == {"addition": 0.3, "brackets": 0.0}


def test_oracle_logits_equal_the_training_forward(trained):
    # The oracle reads only the folder; the training model reads the saved state.  Both
    # float32, one whole-window block-causal forward: they differ by the order of float
    # sums only (SDPA vs an explicit softmax, routed experts gathered vs evaluated
    # densely), ~1e-5 here; a wrong name, routing choice, norm or RoPE detail moves
    # logits by 1e-1 or more.  Blocks of 8 over a 37-token task prompt and canvas.
    model_dir = trained / "model"
    oracle = load_llada2_oracle(str(model_dir))
    state = torch.load(trained / "state.pt", weights_only=False)
    ids = llada2.build_llada2_tokenizer(trained / "tok-check", 512)
    model = llada2.build_model(ids, SHAPE, MOE)
    model.load_state_dict(state["model"])
    model.eval()
    encoder = Llada2Encoder(trained / "tokenizer", ids)
    inst = ALL_TASKS["multiply"].sample(random.Random(0), TEST)
    tokens = torch.tensor(encoder.prompt(inst.prompt) + encoder.canvas(inst.answer, 24) + [ids["mask"]] * 6)
    want = oracle.forward(tokens, oracle_mask(len(tokens), 8))
    pos = torch.arange(len(tokens))[None]
    got = model.logits(model.hidden_states(tokens[None], pos, llada2.block_causal_mask(
        pos // 8, torch.ones_like(pos, dtype=torch.bool))))[0]
    assert (got - want).abs().max().item() < 1e-4 * max(1.0, want.abs().max().item())


def test_the_plugin_serves_the_trained_checkpoint(trained):
    # One engine: the checkpoint loads unmodified through vLLM, the chat prompt is the
    # training encoder's, and greedy LLaDA2.0 decoding gives the oracle's tokens on
    # prompts whose reference run has no exact tie.
    from vllm import SamplingParams

    from lab import eval as task_eval

    model_dir = trained / "model"
    runner = task_eval.OfflineRunner(
        str(model_dir),
        dict(dtype="float32", max_model_len=256, max_num_seqs=8, kv_cache_memory_bytes=64 << 20,
             enforce_eager=True, gpu_memory_utilization=0.3, seed=0),
    )
    try:
        assert not runner.exact, "LLaDA2 decodes with the model's defaults in the eval"
        ids = llada2.build_llada2_tokenizer(trained / "tok-serve", 512)
        encoder = Llada2Encoder(trained / "tokenizer", ids)
        rng = random.Random(3)
        items = [ALL_TASKS[name].sample(rng, TEST) for name in ("addition", "multiply", "brackets") for _ in range(2)]
        prompts = [runner.prompt_ids(i.prompt) for i in items]
        assert prompts == [encoder.prompt(i.prompt) for i in items]
        params = SamplingParams(max_tokens=16, temperature=0.0, extra_args={"block_length": 8, "steps": 8})
        outs = runner.generate(prompts, params)
        assert all(len(o.token_ids) >= 1 for o in outs)
        oracle = load_llada2_oracle(str(model_dir))
        compared = 0
        for prompt, out in zip(prompts, outs):
            want = llada2_generate(oracle, prompt, gen_length=16, mask_id=ids["mask"], eos_id=ids["eos"],
                                   block_length=8, steps=8)
            if want.ties:
                continue
            assert list(out.token_ids) == want.tokens
            compared += 1
        assert compared >= 3
        result = task_eval.evaluate_task(runner, ALL_TASKS["brackets"], 4, seed=0, xargs={"block_length": 8})
        assert result.n == 4 and result.denoising_steps > 0 and result.max_tokens == ALL_TASKS["brackets"].gen_length
        # A task shorter than a block is asked for the whole block (the official defaults' regime).
        result = task_eval.evaluate_task(runner, ALL_TASKS["addition"], 2, seed=0, xargs={})
        assert result.max_tokens == 32 > ALL_TASKS["addition"].gen_length
    finally:
        runner.engine.engine_core.shutdown()


def test_qk_gain_init_sets_the_attention_temperature(tmp_path):
    out = tmp_path / "gains"
    common = ["--arch", "llada2", "--out", str(out), *SIZES, "--tasks", "addition", "--steps", "1",
              "--warmup", "1", "--eval-n", "1", "--save-every", "1", "--checkpoint-dtype", "float32"]
    for bad in ("0", "nan", "inf"):
        with pytest.raises(SystemExit):
            train.main([*common, "--qk-gain-init", bad])
    assert train.main([*common, "--qk-gain-init", "1.5", "--lr", "1e-9"]) == 0
    state = torch.load(out / "state.pt", weights_only=False)
    gains = [v for k, v in state["model"].items() if k.endswith(("query_layernorm.weight", "key_layernorm.weight"))]
    assert len(gains) == 2 * 3 and all(torch.allclose(g, torch.full_like(g, 1.5), atol=1e-6) for g in gains)
    norms = [v for k, v in state["model"].items() if k.endswith("input_layernorm.weight")]
    assert all(torch.allclose(n, torch.ones_like(n), atol=1e-6) for n in norms), "only the QK-norm gains move"


def test_full_size_share_draws_llada2_batches_at_the_full_range(tmp_path):
    out = tmp_path / "share"
    assert train.main(["--arch", "llada2", "--out", str(out), *SIZES, "--tasks", "multiply", "--steps", "2",
                       "--warmup", "1", "--eval-every", "1000", "--save-every", "1", "--checkpoint-dtype", "float32",
                       "--curriculum-threshold", "0.9", "--full-size-share", "1"]) == 0
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r.get("full_size") for r in log] == [True, True]
    assert torch.load(out / "state.pt", weights_only=False)["curriculum"]["seen"]["multiply"] == 0


def test_focus_share_draws_llada2_batches_from_the_hard_part(tmp_path):
    out = tmp_path / "focus"
    # No curriculum: multiply trains at its full sizes, which have a hard part.
    assert train.main(["--arch", "llada2", "--out", str(out), *SIZES, "--tasks", "multiply", "--steps", "2",
                       "--warmup", "1", "--eval-every", "1000", "--save-every", "1", "--checkpoint-dtype", "float32",
                       "--focus-share", "multiply=1"]) == 0
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r.get("focus") for r in log] == [True, True] and not any("full_size" in r for r in log)


def test_mimetic_qk_starts_attention_on_like_tokens():
    """--mimetic-qk: each query head starts as its KV head's key projection (plus the
    stated noise), so before any training a token's query scores the same token's key
    above other tokens' keys in every head; without it the scores are unrelated."""
    rng = random.Random(3)
    ids = torch.tensor([[rng.randrange(100, 2000) for _ in range(24)]])
    positions = torch.zeros_like(ids)  # the same rotation everywhere: content alone decides

    def self_rank_share(model) -> float:
        att = model.model.layers[0].attention
        x = model.model.layers[0].input_layernorm(model.model.word_embeddings(ids))
        q, k, _ = att.project(x, positions)
        scores = q @ k.transpose(-1, -2)  # [1, heads, T, T]
        return (scores.argmax(-1) == torch.arange(ids.shape[1])).float().mean().item()

    plain = tiny_model(0)
    mimetic = tiny_model(0)
    mimetic.mimetic_qk(0.0)
    heads, group = SHAPE["heads"], SHAPE["heads"] // SHAPE["kv_heads"]
    hd = SHAPE["hidden"] // heads
    for layer in mimetic.model.layers:
        w = layer.attention.query_key_value.weight
        for h in range(heads):
            kv = heads + h // group
            assert torch.equal(w[h * hd:(h + 1) * hd], w[kv * hd:(kv + 1) * hd])
    assert self_rank_share(mimetic) == 1.0
    assert self_rank_share(plain) < 0.5
    noisy = tiny_model(0)
    noisy.mimetic_qk(0.1)
    assert self_rank_share(noisy) > 0.9
    k_rows = noisy.model.layers[0].attention.query_key_value.weight[heads * hd:(heads + 1) * hd]
    q_rows = noisy.model.layers[0].attention.query_key_value.weight[:hd]
    assert 0.05 < ((q_rows - k_rows).std() / k_rows.std()).item() < 0.15


def test_mimetic_qk_option_is_checked(tmp_path):
    common = ["--arch", "llada2", "--out", str(tmp_path / "m"), *SIZES, "--tasks", "addition", "--steps", "1",
              "--warmup", "1", "--eval-n", "1", "--save-every", "1"]
    for bad in ("-0.1", "nan", "inf"):
        with pytest.raises(SystemExit):
            train.main([*common, "--mimetic-qk", bad])


def test_mask_range_is_parsed_per_task_and_checked(tmp_path):
    from lab.training.schedule import parse_mask_ranges

    names = ["addition", "multiply"]
    assert parse_mask_ranges("", names) == {"addition": (0.0, 1.0), "multiply": (0.0, 1.0)}
    assert parse_mask_ranges("0.3-0.8,multiply=0.5-1", names) == {"addition": (0.3, 0.8), "multiply": (0.5, 1.0)}
    for bad, said in (("sort=0.5-1", "names no trained task"), ("multiply=0.5", "is not LO-HI"),
                      ("multiply=0.8-0.5", "0 <= LO < HI <= 1"), ("1.2-2", "0 <= LO < HI <= 1"),
                      ("a-b", "is not LO-HI")):
        with pytest.raises(ValueError, match=said):
            parse_mask_ranges(bad, names)
    common = ["--arch", "llada2", "--out", str(tmp_path / "r"), *SIZES, "--tasks", "addition,multiply", "--steps",
              "2", "--warmup", "1", "--eval-every", "1000", "--save-every", "1", "--checkpoint-dtype", "float32"]
    with pytest.raises(SystemExit):
        train.main([*common, "--mask-range", "multiply=0.9-0.1"])
    assert not (tmp_path / "r" / "state.pt").exists(), "a refused range trains nothing"
    assert train.main([*common, "--mask-range", "multiply=0.5-1"]) == 0
    with pytest.raises(SystemExit):
        train.main(["--out", str(tmp_path / "l"), "--steps", "1", "--mask-range", "0.3-0.8"])


def test_working_first_share_orders_only_rows_that_write_working(tmp_path):
    from lab.tasks import Instance
    from lab.train_llada2 import working_first

    encoder = CharEncoder()
    rows = [Instance("multiply", "mul 4821*97=", "33747+433890=467637"), Instance("multiply", "mul 48*7=", "336"),
            Instance("addition", "add 1+2=", "3")]
    assert working_first(rows, encoder, 0.0, random.Random(0)) is None
    assert working_first(rows, encoder, 1.0, random.Random(0)).tolist() == [13, 0, 0]
    ordered = [working_first(rows[:1], encoder, 0.5, random.Random(s)) is not None for s in range(200)]
    assert 60 < sum(ordered) < 140, "about half the rows with working are ordered"
    common = ["--arch", "llada2", "--out", str(tmp_path / "r"), *SIZES, "--tasks", "multiply", "--steps",
              "2", "--warmup", "1", "--eval-every", "1000", "--save-every", "1", "--checkpoint-dtype", "float32"]
    with pytest.raises(SystemExit):
        train.main([*common, "--working-first-share", "1.5"])
    assert not (tmp_path / "r" / "state.pt").exists(), "a refused share trains nothing"
    assert train.main([*common, "--working-first-share", "1"]) == 0
    with pytest.raises(SystemExit):
        train.main(["--out", str(tmp_path / "l"), "--steps", "1", "--working-first-share", "0.5"])


def test_altered_working_share_rewrites_only_rows_that_write_working(tmp_path):
    from lab.tasks import Instance
    from lab.train_llada2 import alter_working

    rows = [Instance("multiply", "mul 4821*97=", "33747+433890=467637"), Instance("multiply", "mul 48*7=", "336"),
            Instance("addition", "add 1+2=", "3")]
    canvases = [CharEncoder().canvas(r.answer, 24) for r in rows]
    assert alter_working(list(rows), list(canvases), CharEncoder(), 0.0, random.Random(0)) is None
    altered, altered_canvases = list(rows), list(canvases)
    given = alter_working(altered, altered_canvases, CharEncoder(), 1.0, random.Random(0))
    assert altered[1:] == rows[1:] and altered_canvases[1:] == canvases[1:]
    assert altered[0].answer != rows[0].answer and altered_canvases[0] == CharEncoder().canvas(altered[0].answer, 24)
    assert given.tolist() == [altered[0].answer.rindex("=") + 1, 0, 0]
    short = [Instance("multiply", "mul 9*99=", "81+810=891")]
    lengths = set()
    for seed in range(40):  # 9*99's sum as altered may gain a digit: its canvas grows to hold it and the end
        short_canvases = [CharEncoder().canvas(short[0].answer, 11)]
        alter_working(list(short), short_canvases, CharEncoder(), 1.0, random.Random(seed))
        assert short_canvases[0][-1] == "<eos>"
        lengths.add(len(short_canvases[0]))
    assert lengths == {11, 12}
    common = ["--arch", "llada2", "--out", str(tmp_path / "r"), *SIZES, "--tasks", "multiply", "--steps",
              "2", "--warmup", "1", "--eval-every", "1000", "--save-every", "1", "--checkpoint-dtype", "float32"]
    with pytest.raises(SystemExit):
        train.main([*common, "--altered-working-share", "-0.1"])
    assert not (tmp_path / "r" / "state.pt").exists(), "a refused share trains nothing"
    assert train.main([*common, "--altered-working-share", "1", "--working-first-share", "1"]) == 0
    with pytest.raises(SystemExit):
        train.main(["--out", str(tmp_path / "l"), "--steps", "1", "--altered-working-share", "0.5"])


def test_a_working_given_task_trains_with_its_working_given_and_is_not_generated(tmp_path):
    from lab.tasks import AUX_TASKS, Instance
    from lab.train_llada2 import alter_working, given_working

    encoder = CharEncoder()
    rows = [Instance("working_sum", "sum the working", "6634+9910=16544"), Instance("working_sum", "sum the working",
                                                                                    "9+931=940")]
    assert given_working(AUX_TASKS["working_sum"], rows, encoder).tolist() == [10, 6]
    assert given_working(ALL_TASKS["addition"], [Instance("addition", "add 1+2=", "3")], encoder) is None
    assert alter_working(list(rows), [list(r.answer) for r in rows], encoder, 1.0, random.Random(0)) is None
    out = tmp_path / "r"
    assert train.main(["--arch", "llada2", "--out", str(out), *SIZES, "--tasks", "working_sum,addition", "--steps",
                       "2", "--warmup", "1", "--eval-every", "2", "--eval-n", "2", "--save-every", "2",
                       "--checkpoint-dtype", "float32", "--altered-working-share", "1"]) == 0
    records = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert set(records[-1]["accuracy"]) == {"addition"}, "a working-given task's generations are not scored"
