"""A trainable plain-PyTorch LLaDA whose state_dict has the checkpoint's own names.

Training only: the serving runtime never imports this module.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.to(x.dtype) * self.weight


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """NeoX rotate-half RoPE in fp32; x: [B, H, L, D], positions: [L]."""
    dim = x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, dim, 2, dtype=torch.float32, device=x.device) / dim)
    freqs = positions.float()[:, None] * inv_freq[None]
    emb = torch.cat([freqs, freqs], dim=-1)
    xf = x.float()
    half = dim // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * emb.cos() + rotated * emb.sin()).to(x.dtype)


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, intermediate: int, theta: float):
        super().__init__()
        self.heads, self.theta = heads, theta
        self.attn_norm = RMSNorm(hidden)
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, hidden, bias=False)
        self.v_proj = nn.Linear(hidden, hidden, bias=False)
        self.attn_out = nn.Linear(hidden, hidden, bias=False)
        self.ff_norm = RMSNorm(hidden)
        self.ff_proj = nn.Linear(hidden, intermediate, bias=False)  # gate
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.ff_out = nn.Linear(intermediate, hidden, bias=False)  # down

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        b, length, hidden = x.shape
        h = self.attn_norm(x)
        q, k, v = (
            proj(h).view(b, length, self.heads, -1).transpose(1, 2)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        positions = torch.arange(length, device=x.device)
        q, k = rope(q, positions, self.theta), rope(k, positions, self.theta)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask, is_causal=False)
        x = x + self.attn_out(attn.transpose(1, 2).reshape(b, length, hidden))
        h = self.ff_norm(x)
        return x + self.ff_out(F.silu(self.ff_proj(h)) * self.up_proj(h))


class Transformer(nn.Module):
    def __init__(self, vocab: int, hidden: int, layers: int, heads: int, intermediate: int, theta: float):
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads, intermediate, theta) for _ in range(layers))
        self.ln_f = RMSNorm(hidden)
        self.ff_out = nn.Linear(hidden, vocab, bias=False)  # the LM head


class TrainableLLaDA(nn.Module):
    def __init__(self, vocab: int, hidden: int, layers: int, heads: int, intermediate: int, theta: float = 500000.0):
        super().__init__()
        self.model = nn.Module()
        self.model.transformer = Transformer(vocab, hidden, layers, heads, intermediate, theta)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for name, param in self.named_parameters():
            if param.dim() == 1:
                nn.init.ones_(param)
            elif name.endswith("wte.weight"):
                nn.init.normal_(param, std=0.02)
            else:
                nn.init.normal_(param, std=param.shape[1] ** -0.5)
        for block in self.model.transformer.blocks:
            # Residual branches start small so the stack begins near the identity.
            block.attn_out.weight.data.mul_(0.5 / len(self.model.transformer.blocks) ** 0.5)
            block.ff_out.weight.data.mul_(0.5 / len(self.model.transformer.blocks) ** 0.5)

    def hidden_states(self, ids: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states [B, L, H]; `lengths` masks right padding out of the keys."""
        t = self.model.transformer
        key_mask = None
        if lengths is not None:
            key_mask = (torch.arange(ids.shape[1], device=ids.device)[None] < lengths[:, None])[:, None, None, :]
        x = t.wte(ids)
        for block in t.blocks:
            x = block(x, key_mask)
        return t.ln_f(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.transformer.ff_out(hidden)

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, L, V]."""
        return self.logits(self.hidden_states(ids, lengths))
