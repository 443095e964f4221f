"""LLaDA2.x checkpoints: the tiny format, and the plugin's model against the oracle.

The plugin's model (vLLM's layers and fused MoE, our paged attention over block-causal
query segments) runs in a child process (tests/llada2_model_run.py); the oracle
(tests/oracle_llada2.py) is a plain full-window forward with an explicit block-causal
mask, as the official generate() computes it.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.oracle_llada2 import block_causal_mask, load_llada2_oracle

BLOCK = 8
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tiny_dirs):
    return tiny_dirs("llada2")


def run_plugin_model(model_dir: str, tokens: list[int], steps: list[list[int]]) -> list[torch.Tensor]:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "llada2_model_run.py"), model_dir, str(BLOCK), json.dumps(tokens),
         json.dumps(steps)],
        capture_output=True, text=True, timeout=600, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("LOGITS "))
    return [torch.tensor(step) for step in json.loads(line[len("LOGITS "):])]


def test_tiny_checkpoint_has_the_released_names_and_keys(model_dir):
    from transformers import AutoConfig, AutoTokenizer

    from vllm_dllm.families import register_hf_classes

    names = set(load_file(os.path.join(model_dir, "model.safetensors")))
    config = json.loads(Path(model_dir, "config.json").read_text())
    assert config["architectures"] == ["LLaDA2MoeModelLM"] and config["model_type"] == "llada2_moe"
    assert "mask_token_id" not in config  # as released: the mask id lives elsewhere
    dense, moe = "model.layers.0.", "model.layers.1."
    assert config["first_k_dense_replace"] == 1 and config["num_shared_experts"] >= 1
    assert config["n_group"] > config["topk_group"] > 0
    for name in ("model.word_embeddings.weight", "model.norm.weight", "lm_head.weight",
                 dense + "attention.query_key_value.weight", dense + "attention.query_layernorm.weight",
                 dense + "attention.key_layernorm.weight", dense + "attention.dense.weight",
                 dense + "mlp.gate_proj.weight", dense + "mlp.up_proj.weight", dense + "mlp.down_proj.weight",
                 moe + "mlp.gate.weight", moe + "mlp.gate.expert_bias", moe + "mlp.experts.0.gate_proj.weight",
                 moe + f"mlp.experts.{config['num_experts'] - 1}.down_proj.weight",
                 moe + "mlp.shared_experts.up_proj.weight"):
        assert name in names, name
    assert not any(name.startswith(moe + "mlp.gate_proj") for name in names)

    register_hf_classes()
    loaded = AutoConfig.from_pretrained(model_dir)
    assert type(loaded).__name__ == "LLaDA2MoeConfig" and loaded.num_key_value_heads < loaded.num_attention_heads
    generation = json.loads(Path(model_dir, "generation_config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert tokenizer.convert_tokens_to_ids("<|mask|>") == generation["mask_token_id"] != 156895
    assert tokenizer.eos_token_id == generation["eos_token_id"] != 156892
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert chat == "<role>HUMAN</role>hi<|role_end|><role>ASSISTANT</role>"


def test_tiny_routing_is_not_trivial(model_dir):
    # The selection bias and the group limit both change which experts win, so a
    # model that ignored either would not match the oracle below.
    oracle = load_llada2_oracle(model_dir)
    x = torch.randn(64, oracle.config["hidden_size"], generator=torch.Generator().manual_seed(0))
    prefix = "model.layers.1.mlp."
    chosen, weights = oracle.route(x, prefix)
    assert torch.allclose(weights.sum(-1), torch.full((64,), oracle.config["routed_scaling_factor"]))
    scores = torch.sigmoid(x @ oracle.w[prefix + "gate.weight"].T)
    unbiased = scores.topk(chosen.shape[1], dim=-1).indices
    biased = (scores + oracle.w[prefix + "gate.expert_bias"]).topk(chosen.shape[1], dim=-1).indices
    as_sets = lambda t: [set(row.tolist()) for row in t]  # noqa: E731
    assert as_sets(chosen) != as_sets(unbiased)
    assert as_sets(chosen) != as_sets(biased)


def test_plugin_model_matches_the_oracle_block_causally(model_dir):
    rng = random.Random(3)
    tokens = [rng.randrange(3, 250) for _ in range(2 * BLOCK + 5)]  # two whole blocks and a partial one
    # A prefill of blocks 0 and 1 in one forward, then block 2 over the cached prefix;
    # then block 1 and 2 again together (a boundary step), over the cached block 0.
    steps = run_plugin_model(model_dir, tokens, [[0, 1], [2], [1, 2]])
    oracle = load_llada2_oracle(model_dir)
    want = oracle.forward(torch.tensor(tokens), block_causal_mask(len(tokens), BLOCK))
    # float32 on both sides; the logits are O(10) and differ by summation order only
    # (~1e-5 measured), far below any routing or masking mistake (O(1)).
    tolerance = 2e-3
    torch.testing.assert_close(steps[0], want[: 2 * BLOCK], atol=tolerance, rtol=0)
    torch.testing.assert_close(steps[1], want[2 * BLOCK:], atol=tolerance, rtol=0)
    torch.testing.assert_close(steps[2], want[BLOCK:], atol=tolerance, rtol=0)
    # Block-causality is what is being matched: the bidirectional forward differs.
    full = oracle.forward(torch.tensor(tokens), torch.ones(len(tokens), len(tokens), dtype=torch.bool))
    assert (full[:BLOCK * 2] - want[:BLOCK * 2]).abs().max() > 1.0
