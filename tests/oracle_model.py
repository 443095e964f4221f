"""Independent test oracle for LLaDA and Dream, part one: the forward pass (checkpoint
loading, RoPE, attention with an optional KV cache) and the random-stream contract.
The reference decoding loops that use them are in tests/oracle.py (LLaDA) and tests/oracle_dream.py (Dream).

Written from /work/shared/MODEL_SPEC.md (sections 1, 1b and 3) and shares no code with
the `vllm_dllm` plugin.  Everything is plain PyTorch on the CPU, float32 by default.

The reference decoders draw their randomness from one global generator.  This oracle
follows the plugin's random-stream contract instead (vllm_dllm/decoding/philox.py),
re-implemented here with numpy's unsigned 64-bit arithmetic:

    Philox4x32-10 (Random123), key = (seed mod 2**32, (seed mod 2**64) >> 32),
    counter = (index, position mod 2**32, step mod 2**32, stream)
    float32 uniform: ((x0 >> 8) + 0.5) * 2**-24
    float64 uniform: (((x0 << 21) | (x1 >> 11)) + 0.5) * 2**-53

`step` is the 0-based global denoising step of the request, `position` the 0-based
canvas index, `stream` one of the constants below and `index` the draw's index in
its row (always 0 here).  Draws replace the
references' samplers as follows: a token at T > 0 (LLaDA's Gumbel-max, Dream's
multinomial) is the smallest id whose float64 cumulative probability under
softmax(logits / T) exceeds u * total, one float64 uniform per row; Dream's alg_temp choice of positions takes the n
largest confidence / alg_temp + Gumbel(u) keys (Gumbel-top-k: the distribution of
multinomial sampling without replacement).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

# --------------------------------------------------------------------------------------
# Random-stream contract
# --------------------------------------------------------------------------------------

STREAM_LLADA_SAMPLE = 1  # LLaDA at T > 0: inverse-CDF draw of the row's token (float64)
STREAM_REMASK = 2  # LLaDA `random` remasking: the row's confidence (float32)
STREAM_FLIP = 3  # Dream `origin`: does the row unmask at this step (float32)
STREAM_SAMPLE = 4  # Dream: inverse-CDF draw of the row's token (float64)
STREAM_SELECT = 5  # Dream with alg_temp: Gumbel key of each position (float64)

_W32 = np.uint64(0xFFFFFFFF)


def philox4x32(counter: list[int], key: list[int], n: int = 1) -> np.ndarray:
    """Philox4x32-10 of counters (c0 + i, c1, c2, c3), i < n: uint64 array [4, n]."""
    c = [np.arange(n, dtype=np.uint64) + np.uint64(counter[0])] + [
        np.full(n, counter[j], dtype=np.uint64) for j in (1, 2, 3)
    ]
    k0, k1 = np.uint64(key[0]), np.uint64(key[1])
    for round_ in range(10):
        if round_:
            k0 = (k0 + np.uint64(0x9E3779B9)) & _W32
            k1 = (k1 + np.uint64(0xBB67AE85)) & _W32
        p0 = c[0] * np.uint64(0xD2511F53)
        p1 = c[2] * np.uint64(0xCD9E8D57)
        c = [(p1 >> np.uint64(32)) ^ c[1] ^ k0, p1 & _W32, (p0 >> np.uint64(32)) ^ c[3] ^ k1, p0 & _W32]
    return np.stack(c)


def _draw_words(seed: int, step: int, position: int, stream: int, n: int) -> np.ndarray:
    s = seed % 2**64
    return philox4x32([0, position % 2**32, step % 2**32, stream], [s % 2**32, s >> 32], n)


def uniform64(seed: int, step: int, position: int, stream: int, n: int = 1) -> torch.Tensor:
    x = _draw_words(seed, step, position, stream, n)
    m = (x[0] << np.uint64(21)) | (x[1] >> np.uint64(11))
    return torch.from_numpy(np.minimum((m.astype(np.float64) + 0.5) * 2.0**-53, 1 - 2.0**-53))


def uniform32(seed: int, step: int, position: int, stream: int) -> float:
    x = _draw_words(seed, step, position, stream, 1)
    u = np.float32((int(x[0][0]) >> 8) + 0.5) * np.float32(2.0**-24)
    return float(min(u, np.float32(1 - 2.0**-24)))


# --------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------


def _load_state_dict(model_dir: str) -> dict[str, torch.Tensor]:
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.exists(single):
        return load_file(single)
    with open(os.path.join(model_dir, "model.safetensors.index.json")) as f:
        index = json.load(f)
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(set(index["weight_map"].values())):
        state.update(load_file(os.path.join(model_dir, shard)))
    missing = set(index["weight_map"]) - set(state)
    if missing:
        raise KeyError(f"tensors listed in the index but absent from the shards: {sorted(missing)[:5]}")
    return state


def _detect_arch(config: dict) -> str:
    names = [a.lower() for a in (config.get("architectures") or [])]
    model_type = str(config.get("model_type", "")).lower()
    if any("moe" in a for a in names):
        raise NotImplementedError("LLaDA-MoE is not covered by the oracle")
    if "lladamodellm" in names or model_type == "llada":
        return "llada"
    if "dreammodel" in names or model_type == "dream":
        return "dream"
    raise ValueError(f"unknown architecture: {config.get('architectures')} / {config.get('model_type')}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, cast back to the input dtype, then times weight."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, theta: float, positions: torch.Tensor | None = None) -> torch.Tensor:
    """NeoX (rotate-half) RoPE on x[B, H, L, D], in float32.

    Row i is rotated by position `positions[i]` (default arange(L))."""
    seq_len, dim = x.shape[-2], x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if positions is None:
        positions = torch.arange(seq_len, dtype=torch.float32)
    else:
        assert positions.shape == (seq_len,)
        positions = positions.to(torch.float32)
    freqs = torch.outer(positions, inv_freq)  # [L, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [L, D]
    cos, sin = emb.cos(), emb.sin()
    x32 = x.float()
    return (x32 * cos + rotate_half(x32) * sin).to(x.dtype)


@dataclass
class _Layer:
    attn_norm: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_bias: torch.Tensor | None
    k_bias: torch.Tensor | None
    v_bias: torch.Tensor | None
    o: torch.Tensor
    mlp_norm: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor


class OracleModel:
    """A bidirectional Llama-style transformer (LLaDA or Dream) with the checkpoint's weights."""

    def __init__(self, model_dir: str, dtype: torch.dtype = torch.float32):
        with open(os.path.join(model_dir, "config.json")) as f:
            self.config: dict = json.load(f)
        self.arch = _detect_arch(self.config)
        self.dtype = dtype
        state = {k: v.to(dtype) for k, v in _load_state_dict(model_dir).items()}
        cfg = self.config
        if self.arch == "llada":
            self.hidden = cfg["d_model"]
            self.n_heads = cfg["n_heads"]
            # n_kv_heads null means n_heads (or 1 with the legacy multi_query_attention flag).
            self.n_kv_heads = cfg.get("n_kv_heads") or (1 if cfg.get("multi_query_attention") else self.n_heads)
            self.n_layers = cfg["n_layers"]
            self.eps = cfg["rms_norm_eps"]
            self.theta = cfg["rope_theta"]
            self._load_llada(state)
        else:
            self.hidden = cfg["hidden_size"]
            self.n_heads = cfg["num_attention_heads"]
            self.n_kv_heads = cfg.get("num_key_value_heads") or self.n_heads
            self.n_layers = cfg["num_hidden_layers"]
            self.eps = cfg["rms_norm_eps"]
            self.theta = cfg["rope_theta"]
            self._load_dream(state)
        self.head_dim = self.hidden // self.n_heads
        self._check_shapes()

    # ---- weight loading ----------------------------------------------------------

    def _load_llada(self, state: dict[str, torch.Tensor]) -> None:
        cfg = self.config
        p = "model.transformer."
        self.embed = state[p + "wte.weight"]
        self.final_norm = state[p + "ln_f.weight"]
        if p + "ff_out.weight" in state:
            self.lm_head = state[p + "ff_out.weight"]
        elif cfg.get("weight_tying"):
            self.lm_head = self.embed
        else:
            raise KeyError(p + "ff_out.weight")
        self.layers = []
        for i in range(self.n_layers):
            b = f"{p}blocks.{i}."
            self.layers.append(
                _Layer(
                    attn_norm=state[b + "attn_norm.weight"],
                    q=state[b + "q_proj.weight"],
                    k=state[b + "k_proj.weight"],
                    v=state[b + "v_proj.weight"],
                    q_bias=state.get(b + "q_proj.bias"),
                    k_bias=state.get(b + "k_proj.bias"),
                    v_bias=state.get(b + "v_proj.bias"),
                    o=state[b + "attn_out.weight"],
                    mlp_norm=state[b + "ff_norm.weight"],
                    gate=state[b + "ff_proj.weight"],  # ff_proj is the gate
                    up=state[b + "up_proj.weight"],
                    down=state[b + "ff_out.weight"],  # per-block ff_out is the down projection
                )
            )
        mlp = cfg.get("mlp_hidden_size") or cfg.get("mlp_ratio", 4) * cfg["d_model"]
        assert self.layers[0].gate.shape[0] == mlp, "mlp_hidden_size does not match ff_proj"
        vocab = cfg.get("embedding_size") or cfg["vocab_size"]
        assert self.embed.shape[0] == vocab, "embedding_size/vocab_size does not match wte"

    def _load_dream(self, state: dict[str, torch.Tensor]) -> None:
        cfg = self.config
        self.embed = state["model.embed_tokens.weight"]
        self.final_norm = state["model.norm.weight"]
        if "lm_head.weight" in state:
            self.lm_head = state["lm_head.weight"]
        elif cfg.get("tie_word_embeddings"):
            self.lm_head = self.embed
        else:
            raise KeyError("lm_head.weight")
        self.layers = []
        for i in range(self.n_layers):
            b = f"model.layers.{i}."
            self.layers.append(
                _Layer(
                    attn_norm=state[b + "input_layernorm.weight"],
                    q=state[b + "self_attn.q_proj.weight"],
                    k=state[b + "self_attn.k_proj.weight"],
                    v=state[b + "self_attn.v_proj.weight"],
                    q_bias=state[b + "self_attn.q_proj.bias"],
                    k_bias=state[b + "self_attn.k_proj.bias"],
                    v_bias=state[b + "self_attn.v_proj.bias"],
                    o=state[b + "self_attn.o_proj.weight"],
                    mlp_norm=state[b + "post_attention_layernorm.weight"],
                    gate=state[b + "mlp.gate_proj.weight"],
                    up=state[b + "mlp.up_proj.weight"],
                    down=state[b + "mlp.down_proj.weight"],
                )
            )
        assert self.layers[0].gate.shape[0] == cfg["intermediate_size"]
        assert self.embed.shape[0] == cfg["vocab_size"]

    def _check_shapes(self) -> None:
        d, hd = self.hidden, self.head_dim
        assert d % self.n_heads == 0 and self.n_heads % self.n_kv_heads == 0
        for layer in self.layers:
            assert layer.q.shape == (self.n_heads * hd, d)
            assert layer.k.shape == (self.n_kv_heads * hd, d)
            assert layer.v.shape == (self.n_kv_heads * hd, d)
            assert layer.o.shape == (d, self.n_heads * hd)
        assert self.lm_head.shape[1] == d

    # ---- forward -----------------------------------------------------------------

    def _attention(
        self,
        h: torch.Tensor,
        layer: _Layer,
        positions: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor] | None,
        key_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """h[B, Q, d]: the normed hidden rows of the query positions `positions[Q]`.

        Keys/values attended over: the cache's (K, V)[B, H_kv, L, D] for every position,
        except the query positions, which use the K/V computed here (RoPE at their true
        positions).  Without a cache the queries must be every position 0..L-1.
        key_mask[B, H_kv, L] (optional): the keys each KV head's queries may see (a
        sparse cache).
        Returns (output[B, Q, d], K_all, V_all, q[B, H, Q, D]), K_all/V_all [B, H_kv, L, D],
        all post-RoPE.
        """
        bsz, n_q, _ = h.shape
        hd = self.head_dim
        q = F.linear(h, layer.q, layer.q_bias).view(bsz, n_q, self.n_heads, hd).transpose(1, 2)
        k = F.linear(h, layer.k, layer.k_bias).view(bsz, n_q, self.n_kv_heads, hd).transpose(1, 2)
        v = F.linear(h, layer.v, layer.v_bias).view(bsz, n_q, self.n_kv_heads, hd).transpose(1, 2)
        q = apply_rope(q, self.theta, positions)
        k = apply_rope(k, self.theta, positions)
        if kv_cache is None:
            k_all, v_all = k, v
        else:
            cache_k, cache_v = kv_cache[:2]
            k_all, v_all = cache_k.clone(), cache_v.clone()
            k_all[:, :, positions] = k
            v_all[:, :, positions] = v
        # GQA: query head j uses key/value head j // (n_heads / n_kv_heads).
        group = self.n_heads // self.n_kv_heads
        k_rep = k_all.repeat_interleave(group, dim=1)
        v_rep = v_all.repeat_interleave(group, dim=1)
        # Full bidirectional attention: no causal mask, no padding mask.
        scores = (q.float() @ k_rep.float().transpose(-1, -2)) / math.sqrt(hd)
        if key_mask is not None:
            visible = key_mask.repeat_interleave(group, dim=1)[:, :, None, :]
            scores = scores.masked_fill(~visible, float("-inf"))
        weights = torch.softmax(scores, dim=-1)
        out = (weights @ v_rep.float()).to(h.dtype)  # [B, H, Q, D]
        out = out.transpose(1, 2).reshape(bsz, n_q, self.n_heads * hd)
        return F.linear(out, layer.o), k_all, v_all, q

    def _mlp(self, h: torch.Tensor, layer: _Layer) -> torch.Tensor:
        return F.linear(F.silu(F.linear(h, layer.gate)) * F.linear(h, layer.up), layer.down)

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, extra_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """ids[B, L] -> raw logits[B, L, V] in float32 (Dream logits are NOT shifted)."""
        return self.forward_queries(ids, extra_embeds=extra_embeds)[0]

    @torch.no_grad()
    def forward_queries(
        self,
        ids: torch.Tensor,
        query_positions=None,
        kv_cache: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
        return_kv: bool = False,
        key_masks: list[torch.Tensor] | None = None,
        return_q: bool = False,
        extra_embeds: torch.Tensor | None = None,
    ):
        """Forward of the query positions of ids[B, L] only.

        query_positions: increasing positions in [0, L) (None: all of them).
        kv_cache: per layer (K, V)[B, H_kv, L, D], post-RoPE, as returned by an earlier call
        with return_kv=True.  Every non-query position attends from the cache; query
        positions use their freshly computed K/V.  Without a cache the queries must be
        every position (a full forward).
        key_masks: per layer [B, H_kv, L], the keys each KV head may see (a sparse cache).
        Returns (logits[B, Q, V] float32, per-layer (K, V) or None): K/V[B, H_kv, L, D]
        are the ones attended over (cache with the query rows replaced); with return_q
        per layer (K, V, q), q[B, H, Q, D] the queries (post-RoPE).
        extra_embeds: [B, L, hidden] added to the token embeddings (IterSmooth).
        """
        bsz, seq_len = ids.shape
        if query_positions is None:
            positions = torch.arange(seq_len)
        else:
            positions = torch.as_tensor(query_positions, dtype=torch.long).reshape(-1)
            assert bool((positions[1:] > positions[:-1]).all()), "query positions must increase"
            assert positions.numel() == 0 or (0 <= int(positions[0]) and int(positions[-1]) < seq_len)
        if kv_cache is None:
            assert torch.equal(positions, torch.arange(seq_len)), "a forward without cache needs every position"
        else:
            assert len(kv_cache) == self.n_layers
            for cache_k, cache_v, *_ in kv_cache:
                assert cache_k.shape == cache_v.shape == (bsz, self.n_kv_heads, seq_len, self.head_dim)
        kv_out = [] if return_kv else None
        x = self.embed[ids[:, positions]]
        if extra_embeds is not None:
            x = x + extra_embeds[:, positions].to(x.dtype)
        for i, layer in enumerate(self.layers):
            attn, k_all, v_all, q = self._attention(
                rms_norm(x, layer.attn_norm, self.eps), layer, positions, None if kv_cache is None else kv_cache[i],
                None if key_masks is None else key_masks[i],
            )
            if kv_out is not None:
                kv_out.append((k_all, v_all, q) if return_q else (k_all, v_all))
            x = x + attn
            x = x + self._mlp(rms_norm(x, layer.mlp_norm, self.eps), layer)
        x = rms_norm(x, self.final_norm, self.eps)
        return F.linear(x, self.lm_head).float(), kv_out

    __call__ = forward


def load_oracle(model_dir: str, dtype: torch.dtype = torch.float32) -> OracleModel:
    return OracleModel(model_dir, dtype)
