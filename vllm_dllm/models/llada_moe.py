"""LLaDA-MoE-7B-A1B (`LLaDAMoEModelLM`, `model_type` "llada") on vLLM's layers.

The released OLMoE layout: separate q/k/v projections (fused here), an optional
per-head RMSNorm of queries and keys before a partial neox RoPE, an optional clamp
of q/k/v; layers whose `moe_layer_freq` entry is 0 have a dense gated MLP, the
others a softmax-routed MoE and, when the config sizes one, a shared expert that
the layer (not the MoE block) adds.  Attention is fully bidirectional and logits are
not shifted, so the engine serves it exactly as LLaDA-8B: same options, same rules.

Routing as the released forward computes it, which vLLM's own routers do not: the
softmax of the router logits (float32) plus `expert_bias` ARE the expert weights (the
bias is not a selection-only correction), the top-k of them are kept without
renormalisation (the config's `norm_topk_prob` is ignored by the release) and cast
to the hidden dtype.  It runs as the fused MoE's custom routing function, so the
experts stay on vLLM's fused kernels, tensor- and expert-parallel.  Checkpoint
tensors load by their released names, unmodified.
"""

from __future__ import annotations

import dataclasses
import re

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.fused_moe import FusedMoEFactory
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import RowParallelLinear
from vllm.model_executor.model_loader.weight_utils import default_weight_loader

from vllm_dllm.attention.paged import DiffusionAttention
from vllm_dllm.models.moe_lm import FUSED_GATE_UP, FusedName, LayerStack, MoeDiffusionLM
from vllm_dllm.models.rope import Rotary
from vllm_dllm.models.token_chunks import RoutedRows, chunked_rows
from vllm_dllm.models.transformer import GatedMLP, TransformerShape, fused_qkv, kv_heads_over_ranks, rank_heads


def _rope_theta(config) -> float:
    parameters = getattr(config, "rope_parameters", None) or {}
    return getattr(config, "rope_theta", None) or parameters.get("rope_theta", 10000.0)


def llada_moe_shape(config) -> TransformerShape:
    """The attention and dense-MLP shape; refuses what the model here does not do."""
    unsupported = []
    if getattr(config, "tie_word_embeddings", False):
        unsupported.append("tie_word_embeddings")
    rope = getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        unsupported.append(f"rope_scaling of type {rope.get('rope_type', rope.get('type'))}")
    if getattr(config, "hidden_act", "silu") != "silu":
        unsupported.append(f"hidden_act={config.hidden_act}")
    if not 0.0 < float(getattr(config, "partial_rotary_factor", 1.0)) <= 1.0:
        unsupported.append(f"partial_rotary_factor={config.partial_rotary_factor}")
    if len(config.moe_layer_freq) != config.num_hidden_layers:
        unsupported.append(f"moe_layer_freq of {len(config.moe_layer_freq)} entries for "
                           f"{config.num_hidden_layers} layers")
    if unsupported:
        raise ValueError(f"LLaDA-MoE config options not supported: {', '.join(unsupported)}")
    return TransformerShape(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.dense_intermediate_size,
        num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads or config.num_attention_heads,
        # The release derives it (and sizes o_proj as hidden -> hidden).
        head_dim=config.hidden_size // config.num_attention_heads,
        rms_norm_eps=config.rms_norm_eps,
        rope_theta=_rope_theta(config),
        max_position=config.max_position_embeddings,
        qkv_bias=bool(config.attention_bias),
    )


class LladaMoeAttention(nn.Module):
    def __init__(self, shape: TransformerShape, config, quant_config, prefix: str):
        super().__init__()
        self.num_heads, self.num_kv_heads = rank_heads(shape)
        self.head_dim = shape.head_dim
        self.q_size = self.num_heads * shape.head_dim
        self.kv_size = self.num_kv_heads * shape.head_dim
        self.qkv_proj = fused_qkv(shape, quant_config, prefix=f"{prefix}.qkv_proj")
        self.q_norm = self.k_norm = None
        if config.qk_layernorm:
            self.q_norm = RMSNorm(shape.head_dim, eps=shape.rms_norm_eps)
            self.k_norm = RMSNorm(shape.head_dim, eps=shape.rms_norm_eps)
        self.clip_qkv = config.clip_qkv
        self.o_proj = RowParallelLinear(
            input_size=shape.num_heads * shape.head_dim,
            output_size=shape.hidden_size,
            bias=shape.qkv_bias,  # the release's attention_bias covers o_proj too
            quant_config=quant_config,
            prefix=f"{prefix}.o_proj",
        )
        self.rotary_emb = Rotary(shape.head_dim, shape.max_position, shape.rope_theta,
                                 float(getattr(config, "partial_rotary_factor", 1.0)))
        self.attn = DiffusionAttention(self.num_heads, self.num_kv_heads, shape.head_dim, prefix=f"{prefix}.attn",
                                       over_ranks=kv_heads_over_ranks(shape))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None:
            q = self.q_norm(q.reshape(-1, self.num_heads, self.head_dim)).reshape(-1, self.q_size)
            k = self.k_norm(k.reshape(-1, self.num_kv_heads, self.head_dim)).reshape(-1, self.kv_size)
        if self.clip_qkv is not None:  # after the QK norm, as released
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q, k = self.rotary_emb(positions, q, k)
        out, _ = self.o_proj(self.attn(q, k, v))
        return out


class LladaMoeExperts(RoutedRows, nn.Module):
    """Router gate (model dtype, no bias), the expert bias, and the routed experts."""

    def __init__(self, config, quant_config, prefix: str):
        super().__init__()
        self.routed_rows(config.num_experts_per_tok, config.expert_intermediate_size)
        # Replicated on every rank, in the model's dtype, never quantised.
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.expert_bias = None
        if config.moe_router_enable_expert_bias:
            # Created in the model's dtype, as the release's buffer ends up.
            self.expert_bias = nn.Parameter(torch.zeros(config.num_experts), requires_grad=False)
            self.expert_bias.weight_loader = default_weight_loader
        self.experts = FusedMoEFactory(
            num_experts=config.num_experts,
            top_k=config.num_experts_per_tok,
            hidden_size=config.hidden_size,
            intermediate_size=config.expert_intermediate_size,
            renormalize=False,
            quant_config=quant_config,
            prefix=f"{prefix}.experts",
            custom_routing_function=self.route,
        )

    def route(self, hidden_states: torch.Tensor, gating_output: torch.Tensor, topk: int,
              renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, expert ids) of each row, exactly as the release's forward."""
        weights = torch.softmax(gating_output, dim=-1, dtype=torch.float32)
        if self.expert_bias is not None:
            weights = weights + self.expert_bias
        weights, ids = torch.topk(weights, topk, dim=-1)
        # The release multiplies the experts' outputs by weights in the hidden dtype.
        return weights.to(hidden_states.dtype), ids

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return chunked_rows(hidden, self.max_rows, self._routed)

    def _routed(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden_states=hidden, router_logits=self.gate(hidden))


class LladaMoeLayer(nn.Module):
    def __init__(self, shape: TransformerShape, config, index: int, quant_config, prefix: str):
        super().__init__()
        self.input_layernorm = RMSNorm(shape.hidden_size, eps=shape.rms_norm_eps)
        self.self_attn = LladaMoeAttention(shape, config, quant_config, prefix=f"{prefix}.self_attn")
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, eps=shape.rms_norm_eps)
        self.shared_expert = None
        if config.moe_layer_freq[index] == 0:
            self.mlp = GatedMLP(shape, quant_config, prefix=f"{prefix}.mlp")
            return
        self.mlp = LladaMoeExperts(config, quant_config, prefix=f"{prefix}.mlp")
        if config.shared_expert_intermediate_size is not None:
            shared = dataclasses.replace(shape, intermediate_size=config.shared_expert_intermediate_size)
            self.shared_expert = GatedMLP(shared, quant_config, prefix=f"{prefix}.shared_expert")

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x))
        h = self.post_attention_layernorm(x)
        out = self.mlp(h)
        if self.shared_expert is not None:
            out = out + self.shared_expert(h)
        return x + out


# q/k/v are separate in the release, fused here.
FUSED_QKV: FusedName = (
    re.compile(r"(.*\.self_attn)\.([qkv])_proj\.(weight|bias)"),
    lambda m: (f"{m.group(1)}.qkv_proj.{m.group(3)}", m.group(2)),
)


class LLaDAMoEModelLM(MoeDiffusionLM):
    fused_names = (FUSED_QKV, FUSED_GATE_UP)

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        config = vllm_config.model_config.hf_config
        shape = llada_moe_shape(config)
        layers = (LladaMoeLayer(shape, config, i, vllm_config.quant_config, prefix=f"{prefix}model.layers.{i}")
                  for i in range(shape.num_layers))
        super().__init__(LayerStack(shape, layers, "embed_tokens"), shape, vllm_config)
