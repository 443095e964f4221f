"""The bidirectional Llama-style transformer both LLaDA and Dream are.

Built from vLLM's tensor-parallel layers; only attention is ours (non-causal, over
the paged pool).  Parameter names here are canonical; each model maps its checkpoint
names onto them (models/weights.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from vllm.distributed import get_tensor_model_parallel_world_size, tensor_model_parallel_all_reduce
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)

from vllm_dllm.attention.paged import DiffusionAttention
from vllm_dllm.attention.sparse import HeadsOverRanks
from vllm_dllm.models.rope import Rotary
from vllm_dllm.models.token_chunks import ChunkedRows, chunked_rows


@dataclass(frozen=True)
class TransformerShape:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position: int
    qkv_bias: bool


def rank_heads(shape: TransformerShape) -> tuple[int, int]:
    """(query heads, KV heads) of this tensor-parallel rank (KV heads replicated when
    there are fewer than ranks)."""
    tp = get_tensor_model_parallel_world_size()
    if shape.num_heads % tp:
        raise ValueError(f"{shape.num_heads} attention heads do not split over TP={tp}")
    return shape.num_heads // tp, max(1, shape.num_kv_heads // tp)


def kv_heads_over_ranks(shape: TransformerShape) -> HeadsOverRanks | None:
    """The KV heads every rank holds, together (a replicated head once per rank), and
    vLLM's all-reduce when tensor parallelism splits them over ranks (the sparse
    cache ranks by every head's scores), else None."""
    ranks = get_tensor_model_parallel_world_size()
    if ranks == 1:
        return None
    return HeadsOverRanks(rank_heads(shape)[1] * ranks, tensor_model_parallel_all_reduce)


def fused_qkv(shape: TransformerShape, quant_config, prefix: str) -> QKVParallelLinear:
    return QKVParallelLinear(
        hidden_size=shape.hidden_size,
        head_size=shape.head_dim,
        total_num_heads=shape.num_heads,
        total_num_kv_heads=shape.num_kv_heads,
        bias=shape.qkv_bias,
        quant_config=quant_config,
        prefix=prefix,
    )


class SelfAttention(nn.Module):
    def __init__(self, shape: TransformerShape, quant_config, prefix: str):
        super().__init__()
        self.num_heads, self.num_kv_heads = rank_heads(shape)
        self.q_size = self.num_heads * shape.head_dim
        self.kv_size = self.num_kv_heads * shape.head_dim
        self.qkv_proj = fused_qkv(shape, quant_config, prefix=f"{prefix}.qkv_proj")
        self.o_proj = RowParallelLinear(
            input_size=shape.num_heads * shape.head_dim,
            output_size=shape.hidden_size,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.o_proj",
        )
        self.rotary_emb = Rotary(shape.head_dim, shape.max_position, shape.rope_theta)
        self.attn = DiffusionAttention(
            self.num_heads, self.num_kv_heads, shape.head_dim, prefix=f"{prefix}.attn",
            over_ranks=kv_heads_over_ranks(shape),
        )

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        out, _ = self.o_proj(self.attn(q, k, v))
        return out


class GatedMLP(ChunkedRows, nn.Module):
    def __init__(self, shape: TransformerShape, quant_config, prefix: str):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            input_size=shape.hidden_size,
            output_sizes=[shape.intermediate_size] * 2,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.gate_up_proj",
        )
        self.down_proj = RowParallelLinear(
            input_size=shape.intermediate_size,
            output_size=shape.hidden_size,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.down_proj",
        )
        self.act = SiluAndMul()
        # Rows per FFN chunk (models/token_chunks.py): a row holds gate and up, then
        # their activation, three times this rank's intermediate width.
        self.chunk_rows(3 * self.down_proj.input_size_per_partition)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return chunked_rows(x, self.max_rows, self._project)

    def _project(self, x: torch.Tensor) -> torch.Tensor:
        x, _ = self.gate_up_proj(x)
        x, _ = self.down_proj(self.act(x))
        return x


class Block(nn.Module):
    def __init__(self, shape: TransformerShape, quant_config, prefix: str):
        super().__init__()
        self.input_norm = RMSNorm(shape.hidden_size, eps=shape.rms_norm_eps)
        self.attn = SelfAttention(shape, quant_config, prefix=f"{prefix}.attn")
        self.post_attn_norm = RMSNorm(shape.hidden_size, eps=shape.rms_norm_eps)
        self.mlp = GatedMLP(shape, quant_config, prefix=f"{prefix}.mlp")

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this block's output, the residual stream before it): each norm adds the
        previous output into the stream as it normalises (one fused op, as vLLM's
        Llama does), and the next block or the final norm adds the last one."""
        if residual is None:
            x, residual = self.input_norm(x), x
        else:
            x, residual = self.input_norm(x, residual)
        x = self.attn(positions, x)
        x, residual = self.post_attn_norm(x, residual)
        return self.mlp(x), residual


class BidirectionalTransformer(nn.Module):
    """Embedding, blocks, final norm and LM head; `forward` returns hidden states."""

    def __init__(self, shape: TransformerShape, quant_config=None, prefix: str = ""):
        super().__init__()
        self.shape = shape
        self.embed = VocabParallelEmbedding(shape.vocab_size, shape.hidden_size)
        self.layers = nn.ModuleList(
            Block(shape, quant_config, prefix=f"{prefix}layers.{i}")
            for i in range(shape.num_layers)
        )
        self.final_norm = RMSNorm(shape.hidden_size, eps=shape.rms_norm_eps)
        self.lm_head = ParallelLMHead(shape.vocab_size, shape.hidden_size, quant_config=quant_config)
        self.logits_processor = LogitsProcessor(shape.vocab_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        return self.final_norm(x, residual)[0]

    def project(self, hidden_rows: torch.Tensor) -> torch.Tensor:
        """Logits for a chunk of hidden rows (full vocabulary, gathered over TP)."""
        return self.logits_processor(self.lm_head, hidden_rows)

    def attention_layers(self) -> list[DiffusionAttention]:
        return [m for m in self.modules() if isinstance(m, DiffusionAttention)]
