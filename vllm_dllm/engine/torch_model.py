"""A plain-torch bidirectional transformer of LLaDA's shape, for the step engine
without vLLM: benchmarks on a bare GPU machine and engine tests.

Same data flow as the served model (models/transformer.py on vLLM's layers):
embedding, RMSNorm, fused QKV with neox RoPE, our DiffusionAttention over the paged
pool, SwiGLU MLP, final norm, LM head.  Random weights: the engine's cost does not
depend on their values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vllm_dllm.attention.paged import DiffusionAttention


@dataclass(frozen=True)
class ModelShape:
    vocab_size: int = 126464
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_layers: int = 32
    num_heads: int = 32
    num_kv_heads: int = 32
    rope_theta: float = 500000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


LLADA_8B = ModelShape()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return (x.float() * torch.rsqrt(variance + eps)).to(x.dtype) * weight


class Rope(nn.Module):
    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        self.register_buffer("inv_freq", theta ** (-torch.arange(0, head_dim, 2).float() / head_dim), persistent=False)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x: [tokens, heads, head_dim], neox style (halves rotated)."""
        angles = positions.float()[:, None] * self.inv_freq[None, :]
        cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
        first, second = x.float().chunk(2, dim=-1)
        return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1).to(x.dtype)


class Layer(nn.Module):
    def __init__(self, shape: ModelShape, index: int):
        super().__init__()
        d, h, hk = shape.hidden_size, shape.num_heads, shape.num_kv_heads
        self.head_dim = shape.head_dim
        self.q_size, self.kv_size = h * self.head_dim, hk * self.head_dim
        self.input_norm = nn.Parameter(torch.ones(d))
        self.post_attn_norm = nn.Parameter(torch.ones(d))
        self.qkv = nn.Linear(d, self.q_size + 2 * self.kv_size, bias=False)
        self.out = nn.Linear(self.q_size, d, bias=False)
        self.gate_up = nn.Linear(d, 2 * shape.intermediate_size, bias=False)
        self.down = nn.Linear(shape.intermediate_size, d, bias=False)
        self.rope = Rope(self.head_dim, shape.rope_theta)
        self.attn = DiffusionAttention(h, hk, self.head_dim, prefix=f"layers.{index}.attn")

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(rms_norm(x, self.input_norm)).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.rope(positions, q.view(len(x), -1, self.head_dim))
        k = self.rope(positions, k.view(len(x), -1, self.head_dim))
        x = x + self.out(self.attn(q, k, v))
        gate, up = self.gate_up(rms_norm(x, self.post_attn_norm)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class TorchDiffusionLM(nn.Module):
    logits_shift = False

    def __init__(self, shape: ModelShape):
        super().__init__()
        self.shape = shape
        self.embed = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.layers = nn.ModuleList(Layer(shape, i) for i in range(shape.num_layers))
        self.final_norm = nn.Parameter(torch.ones(shape.hidden_size))
        self.lm_head = nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        for layer in self.layers:
            x = layer(positions, x)
        return rms_norm(x, self.final_norm)

    def compute_logits(self, hidden_rows: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_rows)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed(input_ids)

    def input_embedding(self) -> nn.Module:
        return self.embed

    def output_head(self) -> nn.Module:
        return self.lm_head

    def attention_layers(self) -> list[DiffusionAttention]:
        return [layer.attn for layer in self.layers]

    def allocate_kv_pool(self, num_blocks: int, block_size: int, dtype: torch.dtype, device) -> None:
        """One page tensor per layer, as vLLM's pool would give (worker/kv_pool.py)."""
        s = self.shape
        for attn in self.attention_layers():
            attn.bind_kv_cache(
                torch.zeros(num_blocks, block_size, 2, s.num_kv_heads, s.head_dim, dtype=dtype, device=device)
            )


def build_model(shape: ModelShape, dtype: torch.dtype, device, seed: int = 0) -> TorchDiffusionLM:
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # an 8B model in float32 would not fit next to its copy
    try:
        with torch.device(device):
            model = TorchDiffusionLM(shape)
    finally:
        torch.set_default_dtype(previous)
    for name, param in model.named_parameters():
        if param.dim() == 2:
            nn.init.normal_(param, std=0.02 if name.startswith("embed") else param.shape[1] ** -0.5)
    return model.eval()
