"""What the MoE diffusion models (LLaDA2.x, LLaDA-MoE) share as vLLM models: the layer
stack under its released names, the LM head and runner surface, and loading released
tensors into the parameters vLLM fuses (experts stacked per layer, gate and up
projections side by side, q/k/v in one)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader

from vllm_dllm.attention.paged import DiffusionAttention
from vllm_dllm.models.moe import EXPERT_WEIGHT, load_expert_weight
from vllm_dllm.models.transformer import TransformerShape

# A checkpoint name pattern and, for a match, (our parameter, shard id).
FusedName = tuple[re.Pattern, Callable[[re.Match], tuple[str, object]]]

# Gate and up projections of dense MLPs and shared experts (LLaDA2's
# `mlp.shared_experts`, LLaDA-MoE's layer-level `shared_expert`).
FUSED_GATE_UP: FusedName = (
    re.compile(r"(.*\.(?:mlp|mlp\.shared_experts|shared_expert))\.(gate_proj|up_proj)\.weight"),
    lambda m: (f"{m.group(1)}.gate_up_proj.weight", 0 if m.group(2) == "gate_proj" else 1),
)


class LayerStack(nn.Module):
    """Embedding, decoder layers and final norm.  The embedding keeps its release's
    attribute name (`embedding`), so checkpoint tensor names are this module's."""

    def __init__(self, shape: TransformerShape, layers: Iterable[nn.Module], embedding: str):
        super().__init__()
        self.embedding = embedding
        self.add_module(embedding, VocabParallelEmbedding(shape.vocab_size, shape.hidden_size))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(shape.hidden_size, eps=shape.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return getattr(self, self.embedding)(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        for layer in self.layers:
            x = layer(positions, x)
        return self.norm(x)

    def attention_layers(self) -> list[DiffusionAttention]:
        return [m for m in self.modules() if isinstance(m, DiffusionAttention)]


class MoeDiffusionLM(nn.Module):
    """A MoE masked-diffusion LM in vLLM's model interface.  Logits are not shifted:
    position j predicts token j."""

    logits_shift = False
    fused_names: tuple[FusedName, ...] = (FUSED_GATE_UP,)

    def __init__(self, model: LayerStack, shape: TransformerShape, vllm_config: VllmConfig):
        super().__init__()
        self.config = vllm_config.model_config.hf_config
        self.model = model
        self.lm_head = ParallelLMHead(shape.vocab_size, shape.hidden_size, quant_config=vllm_config.quant_config)
        self.logits_processor = LogitsProcessor(shape.vocab_size)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed(input_ids)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None) -> torch.Tensor:
        return self.model(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.logits_processor(self.lm_head, hidden_states)

    def input_embedding(self) -> nn.Module:
        """The token embedding (under TP, this rank's vocabulary rows)."""
        return getattr(self.model, self.model.embedding)

    def output_head(self) -> nn.Module:
        """The LM head (under TP, this rank's vocabulary rows)."""
        return self.lm_head

    def prediction_rows(self, positions: torch.Tensor) -> torch.Tensor:
        return positions

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        loaded: set[str] = set()
        for name, tensor in weights:
            expert = EXPERT_WEIGHT.fullmatch(name)
            if expert:
                moe, index, kind = expert.group(1), int(expert.group(2)), expert.group(3)
                loaded.add(load_expert_weight(modules[moe].experts, moe, index, kind, tensor, name))
                continue
            target, shard = name, None
            for pattern, rename in self.fused_names:
                if match := pattern.fullmatch(name):
                    target, shard = rename(match)
                    break
            if target not in params:
                raise ValueError(f"unexpected tensor '{name}' in checkpoint")
            param = params[target]
            loader = getattr(param, "weight_loader", default_weight_loader)
            if shard is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard)
            loaded.add(target)
        return loaded
