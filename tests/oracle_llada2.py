"""Independent test oracle for LLaDA2.x, part one: the forward pass.

Written from the released model's definition (configuration_llada2_moe.py,
modeling_llada2_moe.py: Ling 2.0 attention with per-head QK RMSNorm before a partial
rotate-half RoPE, dense first layers, sigmoid-routed group-limited MoE with a
selection-only expert bias and shared experts) and shares no code with the plugin.
Plain PyTorch on the CPU, float32, one full-window forward with an explicit
attention mask, as the official generate() runs it: every expert is evaluated
densely and the router's choice masks the results (no fused kernel, no pool).
"""

from __future__ import annotations

import json
import os

import torch
import torch.nn.functional as F
from safetensors.torch import load_file


def block_causal_mask(length: int, block_length: int) -> torch.Tensor:
    """bool [L, L]: query i may attend key j when j's block is not after i's."""
    block = torch.arange(length) // block_length
    return block[None, :] <= block[:, None]


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rope(x: torch.Tensor, positions: torch.Tensor, rotary_dim: int, theta: float) -> torch.Tensor:
    """Rotate-half RoPE on the first `rotary_dim` features of each head; x: [L, H, D]."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    angles = positions.float()[:, None] * inv_freq[None, :]
    cos = torch.cat([angles.cos(), angles.cos()], -1)[:, None, :]
    sin = torch.cat([angles.sin(), angles.sin()], -1)[:, None, :]
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], -1)
    return torch.cat([rot * cos + rotated * sin, rest], -1)


class Llada2Oracle:
    def __init__(self, model_dir: str, dtype: torch.dtype = torch.float32):
        with open(os.path.join(model_dir, "config.json")) as f:
            self.config = json.load(f)
        self.w = {k: v.to(dtype) for k, v in load_file(os.path.join(model_dir, "model.safetensors")).items()}
        c = self.config
        self.heads = c["num_attention_heads"]
        self.kv_heads = c["num_key_value_heads"] or self.heads
        self.head_dim = c.get("head_dim") or c["hidden_size"] // self.heads
        self.rotary_dim = int(self.head_dim * c.get("partial_rotary_factor", 1.0))
        self.eps = c["rms_norm_eps"]

    def _mlp(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        gate = x @ self.w[prefix + "gate_proj.weight"].T
        up = x @ self.w[prefix + "up_proj.weight"].T
        return (F.silu(gate) * up) @ self.w[prefix + "down_proj.weight"].T

    def route(self, x: torch.Tensor, prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids [N, k], weights [N, k]) of each row."""
        c = self.config
        logits = x.float() @ self.w[prefix + "gate.weight"].float().T
        scores = torch.sigmoid(logits)
        biased = scores + self.w[prefix + "gate.expert_bias"].float()
        n, experts = biased.shape
        groups = biased.view(n, c["n_group"], experts // c["n_group"])
        group_score = groups.topk(2, dim=-1).values.sum(-1)
        kept_groups = group_score.topk(c["topk_group"], dim=-1).indices
        allowed = torch.zeros(n, c["n_group"], dtype=torch.bool)
        allowed[torch.arange(n)[:, None], kept_groups] = True
        allowed = allowed[:, :, None].expand_as(groups).reshape(n, experts)
        chosen = biased.masked_fill(~allowed, float("-inf")).topk(c["num_experts_per_tok"], dim=-1).indices
        weights = scores.gather(1, chosen)
        if c["num_experts_per_tok"] > 1:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return chosen, weights * c["routed_scaling_factor"]

    def _moe(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        chosen, weights = self.route(x, prefix)
        out = torch.zeros_like(x)
        for e in range(self.config["num_experts"]):
            weight_e = (weights * (chosen == e)).sum(-1).to(x.dtype)
            if bool((weight_e != 0).any()):
                out = out + weight_e[:, None] * self._mlp(x, f"{prefix}experts.{e}.")
        if self.config.get("num_shared_experts"):
            out = out + self._mlp(x, prefix + "shared_experts.")
        return out

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Logits [L, V] of one sequence; mask: bool [L, L] (query, key)."""
        c, w = self.config, self.w
        positions = torch.arange(len(tokens))
        x = w["model.word_embeddings.weight"][tokens]
        for i in range(c["num_hidden_layers"]):
            p = f"model.layers.{i}."
            h = _rms(x, w[p + "input_layernorm.weight"], self.eps)
            qkv = (h @ w[p + "attention.query_key_value.weight"].T).view(len(tokens), -1, self.head_dim)
            q, k, v = qkv.split([self.heads, self.kv_heads, self.kv_heads], dim=1)
            q = _rope(_rms(q, w[p + "attention.query_layernorm.weight"], self.eps), positions, self.rotary_dim,
                      c["rope_theta"])
            k = _rope(_rms(k, w[p + "attention.key_layernorm.weight"], self.eps), positions, self.rotary_dim,
                      c["rope_theta"])
            repeat = self.heads // self.kv_heads
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q, k) / self.head_dim**0.5
            scores = scores.masked_fill(~mask[None], float("-inf"))
            attn = torch.einsum("hqk,khd->qhd", torch.softmax(scores.float(), -1).to(v.dtype), v)
            x = x + attn.reshape(len(tokens), -1) @ w[p + "attention.dense.weight"].T
            h = _rms(x, w[p + "post_attention_layernorm.weight"], self.eps)
            if i < c["first_k_dense_replace"]:
                x = x + self._mlp(h, p + "mlp.")
            else:
                x = x + self._moe(h, p + "mlp.")
        x = _rms(x, w["model.norm.weight"], self.eps)
        return x @ w["lm_head.weight"].T


def load_llada2_oracle(model_dir: str) -> Llada2Oracle:
    return Llada2Oracle(model_dir)
