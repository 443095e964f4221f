"""The sparse MoE feed-forward of LLaDA2.x (Ling 2.0 routing) on vLLM's fused MoE.

Routing, as the released models define it: router logits in float32 from a float32
gate; sigmoid scores; `expert_bias` added for the choice of experts only; the
experts are chosen among the `topk_group` best of `n_group` groups (a group scored by
the sum of its two best biased scores); the chosen experts' unbiased scores are
renormalised and scaled by `routed_scaling_factor`.  vLLM's grouped top-k router
implements exactly this (with a CPU path), so the experts run through its
`FusedMoEFactory` pipeline: tensor- and expert-parallel as vLLM configures it.
The shared experts are a plain gated MLP added to the routed output.

`EXPERT_WEIGHT` / `load_expert_weight` load a checkpoint's per-expert projections
into the fused expert parameters; LLaDA-MoE (models/llada_moe.py) uses them too.
"""

from __future__ import annotations

import re

import torch
from torch import nn
from vllm.model_executor.layers.fused_moe import FusedMoEFactory
from vllm.model_executor.model_loader.weight_utils import default_weight_loader

from vllm_dllm.models.token_chunks import RoutedRows, chunked_rows
from vllm_dllm.models.transformer import GatedMLP

# `<moe>.experts.<e>.<projection>.weight`, the per-expert names of HF MoE checkpoints.
EXPERT_WEIGHT = re.compile(r"(.*\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_EXPERT_SHARD = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def load_expert_weight(experts: nn.Module, moe_name: str, index: int, kind: str, tensor: torch.Tensor,
                       name: str) -> str:
    """Load expert `index`'s `kind` projection into vLLM's fused expert parameters
    (gate and up into w13, down into w2; vLLM's loader takes this rank's share) and
    return the parameter's name under the model."""
    param_name = "w2_weight" if kind == "down_proj" else "w13_weight"
    param = dict(experts.named_parameters())[f"routed_experts.{param_name}"]
    param.weight_loader(param, tensor, name, shard_id=_EXPERT_SHARD[kind], expert_id=index, return_success=False)
    return f"{moe_name}.experts.routed_experts.{param_name}"


class RouterGate(nn.Module):
    """Router logits in float32 (the release computes them from float32 copies of the
    hidden state and the gate), plus the selection-only expert bias."""

    def __init__(self, hidden_size: int, num_experts: int, with_bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32), requires_grad=False)
        self.weight.weight_loader = default_weight_loader
        self.expert_bias = None
        if with_bias:
            self.expert_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32), requires_grad=False)
            self.expert_bias.weight_loader = default_weight_loader

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(hidden.float(), self.weight)


class SparseMoE(RoutedRows, nn.Module):
    def __init__(self, config, shared_mlp_shape, quant_config, prefix: str):
        super().__init__()
        self.routed_rows(config.num_experts_per_tok, config.moe_intermediate_size)
        score_function = getattr(config, "score_function", "sigmoid")
        with_bias = bool(getattr(config, "moe_router_enable_expert_bias", True))
        self.gate = RouterGate(config.hidden_size, config.num_experts, with_bias)
        self.shared_experts = (
            GatedMLP(shared_mlp_shape, quant_config, prefix=f"{prefix}.shared_experts")
            if config.num_shared_experts else None
        )
        grouped = bool(config.n_group) and bool(config.topk_group) and config.n_group > 1
        self.experts = FusedMoEFactory(
            num_experts=config.num_experts,
            top_k=config.num_experts_per_tok,
            hidden_size=config.hidden_size,
            intermediate_size=config.moe_intermediate_size,
            renormalize=bool(getattr(config, "norm_topk_prob", True)),
            use_grouped_topk=grouped,
            num_expert_group=config.n_group if grouped else None,
            topk_group=config.topk_group if grouped else None,
            quant_config=quant_config,
            prefix=f"{prefix}.experts",
            scoring_func=score_function,
            routed_scaling_factor=float(config.routed_scaling_factor),
            e_score_correction_bias=self.gate.expert_bias,
            router_logits_dtype=torch.float32,
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        routed = chunked_rows(hidden, self.max_rows, self._routed)
        if self.shared_experts is not None:
            routed = routed + self.shared_experts(hidden)
        return routed

    def _routed(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden_states=hidden, router_logits=self.gate(hidden))
