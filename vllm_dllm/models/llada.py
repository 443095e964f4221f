"""LLaDA-8B (Instruct / Base / 1.5): `LLaDAModelLM` checkpoints, loaded unmodified."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from vllm.config import VllmConfig

from vllm_dllm.models.diffusion_lm import DiffusionLM
from vllm_dllm.models.transformer import TransformerShape
from vllm_dllm.models.weights import layer, rules

# Trap: `blocks.{i}.ff_out` is the down projection, `transformer.ff_out` the LM head.
_LLADA_NAMES = rules(
    (r"model\.transformer\.wte\.weight", "model.embed.weight"),
    (r"model\.transformer\.ln_f\.weight", "model.final_norm.weight"),
    (r"model\.transformer\.ff_out\.weight", "model.lm_head.weight"),
    (layer(r"model\.transformer\.blocks\.{i}\.attn_norm\.weight"), r"model.layers.\1.input_norm.weight"),
    (layer(r"model\.transformer\.blocks\.{i}\.ff_norm\.weight"), r"model.layers.\1.post_attn_norm.weight"),
    (layer(r"model\.transformer\.blocks\.{i}\.q_proj\.weight"), r"model.layers.\1.attn.qkv_proj.weight", "q"),
    (layer(r"model\.transformer\.blocks\.{i}\.k_proj\.weight"), r"model.layers.\1.attn.qkv_proj.weight", "k"),
    (layer(r"model\.transformer\.blocks\.{i}\.v_proj\.weight"), r"model.layers.\1.attn.qkv_proj.weight", "v"),
    (layer(r"model\.transformer\.blocks\.{i}\.attn_out\.weight"), r"model.layers.\1.attn.o_proj.weight"),
    (layer(r"model\.transformer\.blocks\.{i}\.ff_proj\.weight"), r"model.layers.\1.mlp.gate_up_proj.weight", 0),
    (layer(r"model\.transformer\.blocks\.{i}\.up_proj\.weight"), r"model.layers.\1.mlp.gate_up_proj.weight", 1),
    (layer(r"model\.transformer\.blocks\.{i}\.ff_out\.weight"), r"model.layers.\1.mlp.down_proj.weight"),
)


def llada_shape(config) -> TransformerShape:
    def get(key, default=None):
        return getattr(config, key, default)

    unsupported = {
        "alibi": get("alibi", False),
        "weight_tying": get("weight_tying", False),
        "include_bias": get("include_bias", False),
        "attention_layer_norm": get("attention_layer_norm", False),
        "input_emb_norm": get("input_emb_norm", False),
        "scale_logits": get("scale_logits", False),
    }
    if not get("rope", True):
        unsupported["rope=false"] = True
    if get("block_type", "llama") != "llama":
        unsupported[f"block_type={get('block_type')}"] = True
    bad = [k for k, v in unsupported.items() if v]
    if bad:
        raise ValueError(f"LLaDA config options not supported: {', '.join(bad)}")
    d_model = get("d_model")
    n_heads = get("n_heads")
    return TransformerShape(
        vocab_size=get("embedding_size") or get("vocab_size"),
        hidden_size=d_model,
        intermediate_size=get("mlp_hidden_size") or get("mlp_ratio") * d_model,
        num_layers=get("n_layers"),
        num_heads=n_heads,
        num_kv_heads=get("n_kv_heads") or n_heads,
        head_dim=d_model // n_heads,
        rms_norm_eps=get("rms_norm_eps", 1e-5),
        rope_theta=get("rope_theta", 10000.0),
        max_position=get("max_sequence_length", 4096),
        qkv_bias=bool(get("include_qkv_bias", False)),
    )


class LLaDAModelLM(DiffusionLM):
    logits_shift = False

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__(llada_shape(vllm_config.model_config.hf_config), vllm_config, prefix)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return self.load_with_rules(weights, _LLADA_NAMES)



