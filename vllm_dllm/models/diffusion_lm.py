"""What LLaDA and Dream share as vLLM models: config plumbing and the runner surface."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig

from vllm_dllm.models.transformer import BidirectionalTransformer, TransformerShape
from vllm_dllm.models.weights import NameRule, load_mapped


class DiffusionLM(nn.Module):
    """A masked-diffusion LM in vLLM's model interface.

    `logits_shift`: Dream predicts token j from the hidden state at j-1 (position 0
    from its own); LLaDA predicts token j from position j.
    """

    logits_shift: bool = False

    def __init__(self, shape: TransformerShape, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        self.config = vllm_config.model_config.hf_config
        self.model = BidirectionalTransformer(
            shape, vllm_config.quant_config, prefix=f"{prefix}model."
        )

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate_tensors=None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.model.project(hidden_states)

    def input_embedding(self) -> nn.Module:
        """The token embedding (a VocabParallelEmbedding: under TP, this rank's rows)."""
        return self.model.embed

    def output_head(self) -> nn.Module:
        """The LM head (a ParallelLMHead: under TP, this rank's vocabulary rows)."""
        return self.model.lm_head

    def prediction_rows(self, positions: torch.Tensor) -> torch.Tensor:
        """Sequence positions whose hidden states predict the tokens at `positions`."""
        if not self.logits_shift:
            return positions
        return (positions - 1).clamp(min=0)

    def load_with_rules(
        self, weights: Iterable[tuple[str, torch.Tensor]], name_rules: list[NameRule]
    ) -> set[str]:
        return load_mapped(self, weights, name_rules)
