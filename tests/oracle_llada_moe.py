"""Independent test oracle for LLaDA-MoE: the forward pass.

Written from the released model's definition (configuration_lladamoe.py,
modeling_lladamoe.py: OLMoE attention with separate q/k/v, per-head QK RMSNorm and an
optional q/k/v clamp before a partial rotate-half RoPE, full bidirectional
attention; dense layers where `moe_layer_freq` is 0; a softmax router whose weights
get the expert bias added and are kept, top-k, without renormalisation; a shared
expert added by the layer) and shares no code with the plugin.  Plain PyTorch on the
CPU, float32, one full-window forward; every chosen expert runs on all rows and the
router's weight (0 where it was not chosen) scales it, no fused kernel, no pool.

`forward(ids[B, L])` returns logits [B, L, V], the interface tests/oracle.py's LLaDA
generate() calls (with cache="none"): the model is decoded as LLaDA.
"""

from __future__ import annotations

import json
import os

import torch
import torch.nn.functional as F
from safetensors.torch import load_file


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rope(x: torch.Tensor, rotary_dim: int, theta: float) -> torch.Tensor:
    """Rotate-half RoPE on the first `rotary_dim` features of each head; x: [L, H, D],
    row i at position i."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    angles = torch.arange(x.shape[0], dtype=torch.float32)[:, None] * inv_freq[None, :]
    cos = torch.cat([angles.cos(), angles.cos()], -1)[:, None, :]
    sin = torch.cat([angles.sin(), angles.sin()], -1)[:, None, :]
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], -1)
    return torch.cat([rot * cos + rotated * sin, rest], -1)


class LladaMoeOracle:
    def __init__(self, model_dir: str, dtype: torch.dtype = torch.float32):
        with open(os.path.join(model_dir, "config.json")) as f:
            self.config = json.load(f)
        self.w = {k: v.to(dtype) for k, v in load_file(os.path.join(model_dir, "model.safetensors")).items()}
        c = self.config
        self.heads = c["num_attention_heads"]
        self.kv_heads = c.get("num_key_value_heads") or self.heads
        self.head_dim = c["hidden_size"] // self.heads
        self.rotary_dim = int(self.head_dim * c["partial_rotary_factor"])
        self.eps = c["rms_norm_eps"]

    def _mlp(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        gate = x @ self.w[prefix + "gate_proj.weight"].T
        up = x @ self.w[prefix + "up_proj.weight"].T
        return (F.silu(gate) * up) @ self.w[prefix + "down_proj.weight"].T

    def route(self, x: torch.Tensor, prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids [N, k], weights [N, k]) of each row."""
        logits = x @ self.w[prefix + "gate.weight"].T
        weights = torch.softmax(logits.float(), dim=-1)
        bias = self.w.get(prefix + "expert_bias")
        if bias is not None:
            weights = weights + bias.float()
        weights, chosen = weights.topk(self.config["num_experts_per_tok"], dim=-1)
        return chosen, weights.to(x.dtype)

    def _moe(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        chosen, weights = self.route(x, prefix)
        out = torch.zeros_like(x)
        for e in range(self.config["num_experts"]):
            weight_e = (weights * (chosen == e)).sum(-1)
            if bool((chosen == e).any()):
                out = out + weight_e[:, None] * self._mlp(x, f"{prefix}experts.{e}.")
        return out

    def _attention(self, h: torch.Tensor, p: str) -> torch.Tensor:
        c, w, n = self.config, self.w, h.shape[0]
        q = h @ w[p + "q_proj.weight"].T
        k = h @ w[p + "k_proj.weight"].T
        v = h @ w[p + "v_proj.weight"].T
        if c.get("attention_bias"):
            q, k, v = q + w[p + "q_proj.bias"], k + w[p + "k_proj.bias"], v + w[p + "v_proj.bias"]
        q, k, v = (t.view(n, -1, self.head_dim) for t in (q, k, v))
        if c.get("qk_layernorm"):
            q, k = _rms(q, w[p + "q_norm.weight"], self.eps), _rms(k, w[p + "k_norm.weight"], self.eps)
        if c.get("clip_qkv") is not None:
            q, k, v = (t.clamp(-c["clip_qkv"], c["clip_qkv"]) for t in (q, k, v))
        q, k = _rope(q, self.rotary_dim, c["rope_theta"]), _rope(k, self.rotary_dim, c["rope_theta"])
        repeat = self.heads // self.kv_heads
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / self.head_dim**0.5  # no mask: bidirectional
        attn = torch.einsum("hqk,khd->qhd", torch.softmax(scores.float(), -1).to(v.dtype), v)
        out = attn.reshape(n, -1) @ w[p + "o_proj.weight"].T
        return out + w[p + "o_proj.bias"] if c.get("attention_bias") else out

    @property
    def embed(self) -> torch.Tensor:
        return self.w["model.embed_tokens.weight"]

    def forward_one(self, tokens: torch.Tensor, extra: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [L, V] of one sequence; `extra` [L, hidden] is added to its token
        embeddings (IterSmooth)."""
        c, w = self.config, self.w
        x = w["model.embed_tokens.weight"][tokens]
        if extra is not None:
            x = x + extra.to(x.dtype)
        for i in range(c["num_hidden_layers"]):
            p = f"model.layers.{i}."
            x = x + self._attention(_rms(x, w[p + "input_layernorm.weight"], self.eps), p + "self_attn.")
            h = _rms(x, w[p + "post_attention_layernorm.weight"], self.eps)
            if c["moe_layer_freq"][i] == 0:
                out = self._mlp(h, p + "mlp.")
            else:
                out = self._moe(h, p + "mlp.")
                if c.get("shared_expert_intermediate_size") is not None:
                    out = out + self._mlp(h, p + "shared_expert.")
            x = x + out
        x = _rms(x, w["model.norm.weight"], self.eps)
        return (x @ w["lm_head.weight"].T).float()

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, extra_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """ids[B, L] -> logits [B, L, V] (float32)."""
        extras = [None] * len(ids) if extra_embeds is None else list(extra_embeds)
        return torch.stack([self.forward_one(row, extra) for row, extra in zip(ids, extras)])

    __call__ = forward


def load_llada_moe_oracle(model_dir: str) -> LladaMoeOracle:
    return LladaMoeOracle(model_dir)
