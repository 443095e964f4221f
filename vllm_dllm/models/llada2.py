"""LLaDA2.0 / 2.1 (`LLaDA2MoeModelLM`, `model_type` "llada2_moe") on vLLM's layers.

The Ling 2.0 layout the releases keep: fused `query_key_value`, per-head RMSNorm of
queries and keys before a partial neox RoPE (the first `partial_rotary_factor` of each
head's dimensions), GQA, output projection `dense`; the first `first_k_dense_replace`
layers have a dense gated MLP, the others the routed MoE with shared experts
(models/moe.py).  Logits are not shifted: position j predicts token j.

Attention is block-causal, which the model itself does not know: the step engine
presents each block as its own query segment over the pool, whose context ends at the
block's end (attention/metadata.py), so one non-causal attention call per layer serves
prefill chunks, denoising steps and boundary steps alike.  Checkpoint tensors load by
their released names, unmodified.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import RowParallelLinear

from vllm_dllm.attention.paged import DiffusionAttention
from vllm_dllm.models.moe import SparseMoE
from vllm_dllm.models.moe_lm import LayerStack, MoeDiffusionLM
from vllm_dllm.models.rope import Rotary
from vllm_dllm.models.transformer import GatedMLP, TransformerShape, fused_qkv, rank_heads


def llada2_shape(config) -> TransformerShape:
    unsupported = []
    if getattr(config, "use_sliding_window", False):
        unsupported.append("use_sliding_window")
    if getattr(config, "norm_head", False):
        unsupported.append("norm_head")
    if getattr(config, "tie_word_embeddings", False):
        unsupported.append("tie_word_embeddings")
    rope = getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        unsupported.append(f"rope_scaling of type {rope.get('rope_type', rope.get('type'))}")
    if getattr(config, "hidden_act", "silu") != "silu":
        unsupported.append(f"hidden_act={config.hidden_act}")
    if not getattr(config, "use_qk_norm", True):
        unsupported.append("use_qk_norm=false")
    if unsupported:
        raise ValueError(f"LLaDA2 config options not supported: {', '.join(unsupported)}")
    return TransformerShape(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size or 4 * config.hidden_size,
        num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads or config.num_attention_heads,
        head_dim=config.head_dim or config.hidden_size // config.num_attention_heads,
        rms_norm_eps=config.rms_norm_eps,
        rope_theta=getattr(config, "rope_theta", None) or rope.get("rope_theta", 10000.0),
        max_position=config.max_position_embeddings,
        qkv_bias=bool(getattr(config, "use_qkv_bias", False)),
    )


class Llada2Attention(nn.Module):
    def __init__(self, shape: TransformerShape, config, quant_config, prefix: str):
        super().__init__()
        self.num_heads, self.num_kv_heads = rank_heads(shape)
        self.head_dim = shape.head_dim
        self.q_size = self.num_heads * shape.head_dim
        self.kv_size = self.num_kv_heads * shape.head_dim
        self.query_key_value = fused_qkv(shape, quant_config, prefix=f"{prefix}.query_key_value")
        self.query_layernorm = RMSNorm(shape.head_dim, eps=shape.rms_norm_eps)
        self.key_layernorm = RMSNorm(shape.head_dim, eps=shape.rms_norm_eps)
        self.dense = RowParallelLinear(
            input_size=shape.num_heads * shape.head_dim,
            output_size=shape.hidden_size,
            bias=bool(getattr(config, "use_bias", False)),
            quant_config=quant_config,
            prefix=f"{prefix}.dense",
        )
        self.rotary_emb = Rotary(shape.head_dim, shape.max_position, shape.rope_theta,
                                 float(getattr(config, "partial_rotary_factor", 1.0)))
        self.attn = DiffusionAttention(self.num_heads, self.num_kv_heads, shape.head_dim, prefix=f"{prefix}.attn")

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.query_key_value(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.query_layernorm(q.reshape(-1, self.num_heads, self.head_dim)).reshape(-1, self.q_size)
        k = self.key_layernorm(k.reshape(-1, self.num_kv_heads, self.head_dim)).reshape(-1, self.kv_size)
        q, k = self.rotary_emb(positions, q, k)
        out, _ = self.dense(self.attn(q, k, v))
        return out


class Llada2Layer(nn.Module):
    def __init__(self, shape: TransformerShape, config, index: int, quant_config, prefix: str):
        super().__init__()
        self.input_layernorm = RMSNorm(shape.hidden_size, eps=shape.rms_norm_eps)
        self.attention = Llada2Attention(shape, config, quant_config, prefix=f"{prefix}.attention")
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, eps=shape.rms_norm_eps)
        if index < config.first_k_dense_replace:
            self.mlp = GatedMLP(shape, quant_config, prefix=f"{prefix}.mlp")
        else:
            shared = dataclasses.replace(
                shape, intermediate_size=config.moe_intermediate_size * max(1, config.num_shared_experts)
            )
            self.mlp = SparseMoE(config, shared, quant_config, prefix=f"{prefix}.mlp")

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(positions, self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LLaDA2MoeModelLM(MoeDiffusionLM):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        config = vllm_config.model_config.hf_config
        shape = llada2_shape(config)
        layers = (Llada2Layer(shape, config, i, vllm_config.quant_config, prefix=f"{prefix}model.layers.{i}")
                  for i in range(shape.num_layers))
        super().__init__(LayerStack(shape, layers, "word_embeddings"), shape, vllm_config)
