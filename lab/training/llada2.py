"""Training a small LLaDA2.x-format model (`llada2_moe`) on the generated tasks.

Training only: the serving runtime never imports this module.  What is here:

* `TrainableLLaDA2`, a plain-PyTorch LLaDA2 whose state_dict carries the release's
  tensor names (`model.word_embeddings`, `model.layers.N.attention.query_key_value`,
  `...query_layernorm` / `key_layernorm` / `dense`, a dense `mlp.*` in the first
  `dense_layers` layers, then `mlp.gate.weight` + `mlp.gate.expert_bias`,
  `mlp.experts.E.*`, `mlp.shared_experts.*`, `model.norm`, `lm_head`): Ling 2.0
  attention (per-head QK RMSNorm before a partial rotate-half RoPE, GQA), sigmoid-scored
  group-limited top-k routing whose expert bias only selects (DeepSeek-V3's
  auxiliary-loss-free balancing: the bias is a buffer moved towards balance after each
  step, never by gradients), shared experts.  Its forward takes any attention mask, so
  one model serves the two-copy training layout and plain block-causal decoding.
* The block-causal attention mask decoding reads (the training objective, with its
  two-copy layout, is training/llada2_objective.py).
* The LLaDA2.0 threshold decoder (`generate`) for held-out accuracy during training.
* Checkpoint writing through tools/tiny_llada2.py's own writers (config.json,
  generation_config.json, configuration_llada2_moe.py, the Ling-special tokenizer),
  with the task tokenizer's vocabulary (training/checkpoint.py: ";xy=" and lowercase
  pairs one token, digits and capitals one each).
"""

from __future__ import annotations

import pathlib

import torch
import torch.nn.functional as F
from torch import nn

from vllm_dllm.tools.hf_files import write_json
from vllm_dllm.tools.tiny_llada2 import config as llada2_config
from vllm_dllm.tools.tiny_llada2 import generation_config, write_tokenizer
from vllm_dllm.tools.tiny_parts import copy_config_module

EPS = 1e-6  # rms_norm_eps of tiny_llada2's config
PARTIAL_ROTARY = 0.5  # partial_rotary_factor of tiny_llada2's config
ROUTED_SCALING = 2.5  # routed_scaling_factor of tiny_llada2's config


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = EPS):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def partial_rope(x: torch.Tensor, positions: torch.Tensor, rotary_dim: int, theta: float) -> torch.Tensor:
    """Rotate-half RoPE on the first `rotary_dim` features; x: [B, H, T, D], positions [B, T]."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=x.device) / rotary_dim))
    angles = positions.float()[..., None] * inv_freq  # [B, T, rot/2]
    cos = torch.cat([angles.cos(), angles.cos()], -1)[:, None]
    sin = torch.cat([angles.sin(), angles.sin()], -1)[:, None]
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], -1)
    return torch.cat([(rot * cos + rotated * sin).to(x.dtype), rest], -1)


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, theta: float, head_dim: int | None = None):
        super().__init__()
        self.heads, self.kv_heads, self.theta = heads, kv_heads, theta
        self.head_dim = head_dim or hidden // heads
        self.rotary_dim = int(self.head_dim * PARTIAL_ROTARY)
        self.query_key_value = nn.Linear(hidden, (heads + 2 * kv_heads) * self.head_dim, bias=False)
        self.query_layernorm = RMSNorm(self.head_dim)
        self.key_layernorm = RMSNorm(self.head_dim)
        self.dense = nn.Linear(heads * self.head_dim, hidden, bias=False)

    def project(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v as attention reads them: [B, heads, T, head_dim] each (QK-normed,
        rotated, the KV heads repeated for their query heads)."""
        b, t, _ = x.shape
        qkv = self.query_key_value(x).view(b, t, -1, self.head_dim)
        q, k, v = qkv.split([self.heads, self.kv_heads, self.kv_heads], dim=2)
        q = partial_rope(self.query_layernorm(q).transpose(1, 2), positions, self.rotary_dim, self.theta)
        k = partial_rope(self.key_layernorm(k).transpose(1, 2), positions, self.rotary_dim, self.theta)
        v = v.transpose(1, 2)
        if self.kv_heads != self.heads:
            k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
            v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        return q, k, v

    def weights(self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Attention probabilities [B, heads, T, T] (for inspection; the forward uses SDPA)."""
        q, k, _ = self.project(x, positions)
        scores = (q @ k.transpose(-1, -2)) * self.head_dim**-0.5
        return scores.masked_fill(~mask[:, None], float("-inf")).softmax(-1)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.project(x, positions)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])
        return self.dense(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Gate(nn.Module):
    def __init__(self, hidden: int, experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, hidden))
        # Selection only; moved by `balance`, not by gradients.
        self.register_buffer("expert_bias", torch.zeros(experts))


class MoE(nn.Module):
    def __init__(self, hidden: int, moe: dict):
        super().__init__()
        self.moe = moe
        self.gate = Gate(hidden, moe["num_experts"])
        self.experts = nn.ModuleList(MLP(hidden, moe["moe_intermediate"]) for _ in range(moe["num_experts"]))
        shared = moe["moe_intermediate"] * moe["shared_experts"]
        self.shared_experts = MLP(hidden, shared) if shared else None
        self.register_buffer("load", torch.zeros(moe["num_experts"]), persistent=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(experts [N, k], weights [N, k]): the release's routing (sigmoid scores;
        the bias picks the group-limited top-k; weights are the unbiased scores of the
        chosen, renormalised, times routed_scaling_factor)."""
        m = self.moe
        scores = torch.sigmoid(x.float() @ self.gate.weight.float().T)
        biased = scores.detach() + self.gate.expert_bias
        n, experts = biased.shape
        groups = biased.view(n, m["n_group"], experts // m["n_group"])
        kept = groups.topk(2, dim=-1).values.sum(-1).topk(m["topk_group"], dim=-1).indices
        allowed = torch.zeros(n, m["n_group"], dtype=torch.bool, device=x.device)
        allowed[torch.arange(n, device=x.device)[:, None], kept] = True
        allowed = allowed[:, :, None].expand_as(groups).reshape(n, experts)
        chosen = biased.masked_fill(~allowed, float("-inf")).topk(m["experts_per_token"], dim=-1).indices
        weights = scores.gather(1, chosen)
        if m["experts_per_token"] > 1:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return chosen, weights * ROUTED_SCALING

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Each (token, slot) pair sorted by its expert, every expert run once on its
        contiguous run, the results put back in (token, slot) order and summed over
        the slots.  Both reorderings are permutations whose backwards are gathers: a
        gather per expert with index_add scatters every expert's gradient into a
        zeroed [tokens, hidden] instead (1.3-1.5x slower per MoE layer on this CPU,
        lab/probes/llada2_moe_backward.py)."""
        n, hidden = x.shape
        if not n:
            out = torch.zeros_like(x)
        else:
            chosen, weights = self.route(x)
            k = chosen.shape[1]
            flat = chosen.flatten()
            order = flat.argsort(stable=True)  # sorted position -> pair (token * k + slot)
            position = torch.empty_like(order)
            position[order] = torch.arange(len(order), device=order.device)  # pair -> sorted position
            counts = torch.bincount(flat, minlength=len(self.experts))
            grouped = Permutation.apply(x, order.div(k, rounding_mode="floor"), position, k)
            parts = grouped.split(counts.tolist())
            computed = torch.cat([expert(part) for expert, part in zip(self.experts, parts) if len(part)])
            pairs = Permutation.apply(computed, position, order, 1)
            out = (pairs.view(n, k, hidden) * weights[..., None].to(x.dtype)).sum(1)
            if self.training:
                self.load += counts.float()
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


class Permutation(torch.autograd.Function):
    """rows[index] where each row of `rows` is taken `copies` times: `back` lists,
    for source row r, the output positions of its copies at [r * copies, (r + 1) *
    copies), so the backward is a gather and a sum over copies (no scatter)."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, index: torch.Tensor, back: torch.Tensor, copies: int) -> torch.Tensor:
        ctx.save_for_backward(back)
        ctx.shape = (rows.shape[0], copies, rows.shape[1])
        return rows.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (back,) = ctx.saved_tensors
        return grad.index_select(0, back).view(ctx.shape).sum(1), None, None, None


class Layer(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, intermediate: int, theta: float, dense: bool, moe: dict,
                 head_dim: int | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden)
        self.attention = Attention(hidden, heads, kv_heads, theta, head_dim)
        self.post_attention_layernorm = RMSNorm(hidden)
        self.mlp = MLP(hidden, intermediate) if dense else MoE(hidden, moe)

    def forward(self, x, positions, mask, valid):
        x = x + self.attention(self.input_layernorm(x), positions, mask)
        h = self.post_attention_layernorm(x)
        if isinstance(self.mlp, MoE):
            # Tokens only: padding is neither computed nor counted in the experts' load.
            out = torch.zeros_like(h)
            out[valid] = self.mlp(h[valid])
            return x + out
        return x + self.mlp(h)


class TrainableLLaDA2(nn.Module):
    def __init__(self, vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int,
                 theta: float, moe: dict, head_dim: int | None = None):
        super().__init__()
        self.moe = dict(moe)
        self.model = nn.Module()
        self.model.word_embeddings = nn.Embedding(vocab, hidden)
        self.model.layers = nn.ModuleList(
            Layer(hidden, heads, kv_heads, intermediate, theta, i < moe["dense_layers"], moe, head_dim)
            for i in range(layers)
        )
        self.model.norm = RMSNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        depth = len(self.model.layers)
        for name, param in self.named_parameters():
            if param.dim() == 1:
                nn.init.ones_(param)
            elif name.endswith("word_embeddings.weight"):
                nn.init.normal_(param, std=0.02)
            else:
                nn.init.normal_(param, std=param.shape[1] ** -0.5)
        for name, param in self.named_parameters():
            # Residual branches start small so the stack begins near the identity.
            if name.endswith(("attention.dense.weight", "down_proj.weight")):
                param.data.mul_(0.5 / depth**0.5)

    @torch.no_grad()
    def set_qk_gains(self, gain: float) -> None:
        """Every layer's query and key RMSNorm gains to `gain`.  With QK-norm a logit
        is at most sqrt(head_dim) x g_q x g_k: at 1.0 and a head of 48 about 7, which
        caps how sharply a head can single out one of a few hundred positions."""
        for layer in self.model.layers:
            layer.attention.query_layernorm.weight.fill_(gain)
            layer.attention.key_layernorm.weight.fill_(gain)

    @torch.no_grad()
    def mimetic_qk(self, noise: float) -> None:
        """Mimetic initialisation of the query/key projections (Trockman & Kolter
        2023; for recall, Trockman et al. 2024): every query head starts as its KV
        head's key projection plus `noise` times a fresh draw (relative to the
        weights' scale), so a query-key score starts as W_k x . W_k y (for noise 0),
        a positive semi-definite form that scores a token highest against tokens like
        itself: the matching half of a lookup is there from the first step."""
        for layer in self.model.layers:
            att = layer.attention
            hd, heads, kv = att.head_dim, att.heads, att.kv_heads
            weight = att.query_key_value.weight
            q = weight[: heads * hd].view(heads, hd, -1)
            k = weight[heads * hd: (heads + kv) * hd].view(kv, hd, -1)
            for h in range(heads):
                own = k[h // (heads // kv)]
                q[h] = own + noise * torch.randn_like(own) * own.std()

    def moe_layers(self) -> list[MoE]:
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, MoE)]

    def hidden_states(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                      valid: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states [B, T, H]; mask: bool [B, T, T] (query, key); valid: bool
        [B, T], the rows that are tokens (not padding)."""
        return self.hidden_states_and_tap(ids, positions, mask, valid, tap=None)[0]

    def hidden_states_and_tap(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                              valid: torch.Tensor | None, tap: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(final hidden states, the residual stream after layer `tap`, 0-based; None
        without a tap), as `hidden_states` reads its inputs."""
        if valid is None:
            valid = torch.ones_like(ids, dtype=torch.bool)
        if tap is not None and not 0 <= tap < len(self.model.layers):
            raise ValueError(f"no layer {tap} to tap in a model of {len(self.model.layers)} layers")
        x = self.model.word_embeddings(ids)
        tapped = None
        for index, layer in enumerate(self.model.layers):
            x = layer(x, positions, mask, valid)
            if index == tap:
                tapped = x
        return self.model.norm(x), tapped

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    @torch.no_grad()
    def balance(self, rate: float) -> None:
        """Auxiliary-loss-free load balancing (DeepSeek-V3, which LLaDA2's Ling 2.0 base
        follows): after a step, raise each under-loaded expert's selection bias by
        `rate` and lower each over-loaded one's; then start counting afresh."""
        for moe in self.moe_layers():
            if rate and moe.load.sum() > 0:
                moe.gate.expert_bias += rate * torch.sign(moe.load.mean() - moe.load)
            moe.load.zero_()


# ---------------------------------------------------------------------------------------
# Block-causal attention (decoding)
# ---------------------------------------------------------------------------------------


def block_causal_mask(blocks: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """bool [B, T, T]: a query sees keys of its own and earlier blocks (decoding)."""
    mask = (blocks[:, None, :] <= blocks[:, :, None]) & valid[:, None, :]
    return mask | torch.eye(blocks.shape[1], dtype=torch.bool, device=blocks.device)[None]


# ---------------------------------------------------------------------------------------
# LLaDA2.0 decoding with the training model (held-out accuracy during training)
# ---------------------------------------------------------------------------------------


@torch.no_grad()
def generate(model, prompts: list[list[int]], gen_length: int, *, mask_id: int, eos_id: int,
             block_length: int = 32, threshold: float = 0.95) -> list[list[int]]:
    """LLaDA2.0's generate (steps = block_length: a quota of one token per step; every
    masked position above `threshold` is committed when they reach the quota, else the
    most confident one), batched, a whole-window block-causal forward per step as the
    official loop runs it.  The mask id is never a prediction (as the plugin).  Returns
    each row's `gen_length` tokens, cut after the first EOS."""
    device = next(model.parameters()).device
    b = len(prompts)
    totals = [-(-(len(p) + gen_length) // block_length) * block_length for p in prompts]
    width = max(totals)
    x = torch.full((b, width), eos_id, dtype=torch.long)
    valid = torch.zeros((b, width), dtype=torch.bool)
    for i, (p, total) in enumerate(zip(prompts, totals)):
        x[i, :total] = mask_id
        x[i, : len(p)] = torch.tensor(p)
        valid[i, :total] = True
    positions = torch.arange(width)[None].expand(b, width)
    mask = block_causal_mask(positions // block_length, valid)
    block = [len(p) // block_length for p in prompts]
    steps = [0] * b
    done = [False] * b
    while True:
        for i in range(b):
            while not done[i]:
                start, end = block[i] * block_length, (block[i] + 1) * block_length
                if (x[i, start:end] == mask_id).any() and steps[i] < block_length:
                    break
                p = len(prompts[i])
                if end >= totals[i] or (x[i, p:end] == eos_id).any():
                    done[i] = True
                else:
                    block[i] += 1
                    steps[i] = 0
        if all(done):
            break
        hidden = model.hidden_states(x.to(device), positions.to(device), mask.to(device), valid.to(device))
        for i in range(b):
            if done[i]:
                continue
            start, end = block[i] * block_length, (block[i] + 1) * block_length
            logits = model.logits(hidden[i, start:end]).float().cpu()
            probs = logits.softmax(-1)
            logits[:, mask_id] = float("-inf")
            tokens = logits.argmax(-1)
            conf = probs.gather(1, tokens[:, None]).squeeze(1)
            active = x[i, start:end] == mask_id
            conf = torch.where(active, conf, torch.tensor(float("-inf")))
            chosen = (conf > threshold) & active
            if int(chosen.sum()) < 1:
                chosen = torch.zeros_like(active)
                chosen[conf.argmax()] = True
            x[i, start:end] = torch.where(chosen, tokens, x[i, start:end])
            steps[i] += 1
    out = []
    for i, p in enumerate(prompts):
        tokens = x[i, len(p): len(p) + gen_length].tolist()
        out.append(tokens[: tokens.index(eos_id) + 1] if eos_id in tokens else tokens)
    return out


# ---------------------------------------------------------------------------------------
# Tokenizer and checkpoint
# ---------------------------------------------------------------------------------------


def build_llada2_tokenizer(out: pathlib.Path, max_len: int) -> dict[str, int]:
    """The task tokenizer's vocabulary (training/checkpoint.py) with Ling's specials
    after it, written by tiny_llada2's writer; embedding rows padded to a multiple of 64."""
    from vllm_dllm.tools.tiny_llada2 import SMALL_LLADA2_SPECIALS
    from lab.training.checkpoint import _vocab_and_merges

    out.mkdir(parents=True, exist_ok=True)
    vocab, merges = _vocab_and_merges()
    rows = -(-(len(vocab) + len(SMALL_LLADA2_SPECIALS)) // 64) * 64
    # No regex split: merges cross punctuation (";xy=" is one token).
    return write_tokenizer(out, vocab, merges, max_len, use_regex=False, vocab_size=rows)


def moe_settings(args) -> dict:
    return dict(num_experts=args.experts, experts_per_token=args.experts_per_token, n_group=args.expert_groups,
                topk_group=args.topk_groups, moe_intermediate=args.moe_intermediate,
                shared_experts=args.shared_experts, dense_layers=args.dense_layers)


def check_moe(moe: dict, layers: int) -> None:
    if moe["num_experts"] % moe["n_group"]:
        raise ValueError("--experts must be a multiple of --expert-groups")
    if not 1 <= moe["topk_group"] <= moe["n_group"]:
        raise ValueError("--topk-groups must be between 1 and --expert-groups")
    per_group = moe["num_experts"] // moe["n_group"]
    if per_group < 2:
        raise ValueError("each expert group needs two experts (groups are scored by their top two)")
    if moe["experts_per_token"] > per_group * moe["topk_group"]:
        raise ValueError("--experts-per-token exceeds the experts of the kept groups")
    if not 0 <= moe["dense_layers"] < layers:
        raise ValueError("--dense-layers must leave at least one MoE layer")


def write_llada2_checkpoint(out: pathlib.Path, state_dict: dict[str, torch.Tensor], shape: dict, moe: dict, *,
                            max_len: int, dtype: torch.dtype = torch.bfloat16, generation: dict | None = None) -> None:
    """An unmodified LLaDA2.x checkpoint folder in tiny_llada2's format (sizes and RoPE
    theta from `shape`, `moe`), with the task tokenizer."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    ids = build_llada2_tokenizer(out, max_len)
    copy_config_module(out, "llada2.py", "configuration_llada2_moe.py")
    dtype_name = {torch.bfloat16: "bfloat16", torch.float32: "float32"}[dtype]
    cfg = llada2_config(ids=ids, hidden=shape["hidden"], layers=shape["layers"], heads=shape["heads"],
                        kv_heads=shape["kv_heads"], intermediate=shape["intermediate"], dtype=dtype_name,
                        max_len=max_len, moe=moe, head_dim=shape.get("head_dim"))
    cfg["rope_theta"] = float(shape["rope_theta"])
    write_json(out / "config.json", cfg)
    write_json(out / "generation_config.json", {**generation_config(ids), **(generation or {})})
    tensors = {k: v.detach().to(dtype).contiguous() for k, v in state_dict.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)


def build_model(ids: dict, shape: dict, moe: dict) -> TrainableLLaDA2:
    return TrainableLLaDA2(ids["vocab_size"], shape["hidden"], shape["layers"], shape["heads"], shape["kv_heads"],
                           shape["intermediate"], shape["rope_theta"], moe, shape.get("head_dim"))

