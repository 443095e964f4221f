"""LLaDA-MoE checkpoints: the tiny format, the "llada" config dispatch, and the
plugin's model against the oracle.

The plugin's model (vLLM's layers and fused MoE with the release's routing, our paged
attention) runs in a child process (tests/llada_moe_model_run.py); the oracle
(tests/oracle_llada_moe.py) is a plain full-window bidirectional forward.
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

from tests.oracle_llada_moe import LladaMoeOracle, load_llada_moe_oracle

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tiny_dirs):
    return tiny_dirs("llada-moe")


def run_plugin_model(model_dir: str, tokens: list[int], ranges: list[list[int]]) -> list[torch.Tensor]:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "llada_moe_model_run.py"), model_dir, json.dumps(tokens),
         json.dumps(ranges)],
        capture_output=True, text=True, timeout=600, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("LOGITS "))
    return [torch.tensor(step) for step in json.loads(line[len("LOGITS "):])]


def test_tiny_checkpoint_has_the_released_names_and_keys(model_dir):
    from transformers import AutoConfig, AutoTokenizer

    from vllm_dllm.configs import LLaDAMoEConfig
    from vllm_dllm.families import register_hf_classes

    names = set(load_file(os.path.join(model_dir, "model.safetensors")))
    config = json.loads(Path(model_dir, "config.json").read_text())
    assert config["architectures"] == ["LLaDAMoEModelLM"] and config["model_type"] == "llada"
    assert config["auto_map"]["AutoConfig"] == "configuration_lladamoe.LLaDAConfig"
    assert "mask_token_id" not in config  # as released: the mask id lives elsewhere
    assert config["moe_layer_freq"] == [0, 1] and config["qk_layernorm"] and config["moe_router_enable_expert_bias"]
    assert 0 < config["partial_rotary_factor"] < 1 and config["shared_expert_intermediate_size"]
    dense, moe = "model.layers.0.", "model.layers.1."
    for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
                 dense + "self_attn.q_proj.weight", dense + "self_attn.k_proj.weight",
                 dense + "self_attn.v_proj.weight", dense + "self_attn.o_proj.weight",
                 dense + "self_attn.q_norm.weight", dense + "self_attn.k_norm.weight",
                 dense + "input_layernorm.weight", dense + "post_attention_layernorm.weight",
                 dense + "mlp.gate_proj.weight", dense + "mlp.up_proj.weight", dense + "mlp.down_proj.weight",
                 moe + "mlp.gate.weight", moe + "mlp.expert_bias", moe + "mlp.experts.0.gate_proj.weight",
                 moe + f"mlp.experts.{config['num_experts'] - 1}.down_proj.weight",
                 moe + "shared_expert.gate_proj.weight", moe + "shared_expert.down_proj.weight"):
        assert name in names, name
    assert not any(name.startswith((dense + "shared_expert", dense + "mlp.gate.", moe + "mlp.gate_proj"))
                   for name in names)

    # "llada" is LLaDA-8B's model type too: the registered class must hand this dict
    # to the MoE config, with and without the folder's own configuration code.
    register_hf_classes()
    for trust_remote_code in (False, True):
        loaded = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
        assert type(loaded) is LLaDAMoEConfig
        assert (loaded.hidden_size, loaded.num_attention_heads, loaded.moe_layer_freq) == (
            config["hidden_size"], config["num_attention_heads"], config["moe_layer_freq"])
        assert getattr(loaded, "mask_token_id", None) is None  # never LLaDA-8B's default
    generation = json.loads(Path(model_dir, "generation_config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert tokenizer.convert_tokens_to_ids("<|mask|>") == generation["mask_token_id"] != 156895
    assert tokenizer.eos_token_id == generation["eos_token_id"] == config["eos_token_id"] != 156892


def test_llada_8b_configs_still_resolve_to_llada_config(tiny_dirs):
    from transformers import AutoConfig

    from vllm_dllm.configs import LLaDAConfig
    from vllm_dllm.families import register_hf_classes

    register_hf_classes()
    loaded = AutoConfig.from_pretrained(tiny_dirs("llada"))
    assert type(loaded) is LLaDAConfig and loaded.mask_token_id == 298


def test_llada_moe_is_served_as_llada():
    from types import SimpleNamespace

    from vllm_dllm.options import LLADA
    from vllm_dllm.serving.server_config import served_kind

    for architecture in ("LLaDAMoEModelLM", "LLaDAMoeModelLM", "LLaDAMoEModel"):
        assert served_kind(SimpleNamespace(hf_config=SimpleNamespace(architectures=[architecture]))) == LLADA


def test_tiny_routing_is_not_trivial(model_dir):
    # The expert bias changes both which experts win and what they weigh, and the
    # kept weights do not sum to one: a model that used the bias for selection only
    # (the common "correction bias"), ignored it, or renormalised would differ.
    oracle = load_llada_moe_oracle(model_dir)
    x = torch.randn(64, oracle.config["hidden_size"], generator=torch.Generator().manual_seed(0))
    prefix = "model.layers.1.mlp."
    chosen, weights = oracle.route(x, prefix)
    softmax = torch.softmax(x @ oracle.w[prefix + "gate.weight"].T, dim=-1)
    unbiased = softmax.topk(chosen.shape[1], dim=-1).indices
    as_sets = lambda t: [set(row.tolist()) for row in t]  # noqa: E731
    assert as_sets(chosen) != as_sets(unbiased)
    assert (weights - softmax.gather(1, chosen)).abs().max() > 0.05
    assert (weights.sum(-1) - 1).abs().max() > 0.05


class SelectionOnlyBias(LladaMoeOracle):
    """The routing vLLM's biased routers implement: the bias picks, the softmax weighs."""

    def route(self, x, prefix):
        chosen, _ = super().route(x, prefix)
        softmax = torch.softmax((x @ self.w[prefix + "gate.weight"].T).float(), dim=-1)
        return chosen, softmax.gather(1, chosen).to(x.dtype)


def test_plugin_model_matches_the_oracle_bidirectionally(model_dir):
    rng = random.Random(5)
    tokens = [rng.randrange(3, 250) for _ in range(37)]
    # A Refresh (every position) fills the pool; a Reuse of one block then reads the
    # other positions' K/V from it.
    steps = run_plugin_model(model_dir, tokens, [[0, len(tokens)], [8, 24]])
    oracle = load_llada_moe_oracle(model_dir)
    want = oracle.forward(torch.tensor([tokens]))[0]
    # float32 on both sides; the logits are O(10) and differ by summation order only
    # (~1e-5 measured), far below any routing, RoPE or masking mistake (O(0.1-1)).
    tolerance = 2e-3
    torch.testing.assert_close(steps[0], want, atol=tolerance, rtol=0)
    torch.testing.assert_close(steps[1], want[8:24], atol=tolerance, rtol=0)
    # The release's routing is what is being matched: vLLM's usual biased routing differs.
    other = SelectionOnlyBias(model_dir).forward(torch.tensor([tokens]))[0]
    assert (other - steps[0]).abs().max() > 50 * tolerance
