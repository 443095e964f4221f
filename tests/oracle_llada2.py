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
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from tests.oracle_rules import cut_is_tied, parallel_selection


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

    @property
    def embed(self) -> torch.Tensor:
        return self.w["model.word_embeddings.weight"]

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor, extra: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [L, V] of one sequence; mask: bool [L, L] (query, key); `extra`
        [L, hidden] is added to the token embeddings (IterSmooth)."""
        c, w = self.config, self.w
        positions = torch.arange(len(tokens))
        x = w["model.word_embeddings.weight"][tokens]
        if extra is not None:
            x = x + extra.to(x.dtype)
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


# --------------------------------------------------------------------------------------
# LLaDA2.0 and LLaDA2.1 generate(), written from their definitions: a whole-window
# forward with the block-causal mask at every step, no cache, batch of one.
# --------------------------------------------------------------------------------------


@dataclass
class Llada2Result:
    tokens: list[int]  # the generated tokens up to and including the first EOS
    ties: int  # selections decided by an exact tie (quota cut, threshold or argmax)
    forwards: int  # forward passes run
    forwards_to_output: int  # forwards run until every returned token was final (see below)
    blocks: int  # blocks decoded
    edits: int  # positions rewritten by token editing


def _argmax_tied(row: torch.Tensor) -> bool:
    return bool((row == row.max()).sum() > 1)


def _masks_to_commit(p: torch.Tensor, active: torch.Tensor, threshold: float, quota: int):
    """(chosen, tied): every active position above the threshold when they reach the
    quota, else the quota's most confident; tied when the quota's cut is an exact tie."""
    conf = torch.where(active, p, torch.tensor(float("-inf")))
    high = (conf > threshold) & active
    if int(high.sum()) >= quota:
        return high, 0
    n = min(quota, int(active.sum()))
    ordered = conf.sort(descending=True).values
    tied = int(0 < n < len(ordered) and bool(ordered[n - 1] == ordered[n]) and bool(ordered[n] > float("-inf")))
    chosen = torch.zeros(len(p), dtype=torch.bool)
    chosen[conf.topk(n).indices] = True
    return chosen, tied


def _rule_masks(decoding: str, p: torch.Tensor, dist: torch.Tensor, active: torch.Tensor, floor: int, *,
                threshold: float, **params):
    """(chosen, tied): the masks a parallel rule commits (tests/oracle_rules.py's
    parallel_selection, LLaDA's reference selection) among the block's active
    positions, ranked by its keys (confidence `p`; negated entropy of `dist`, the
    distribution `p` is read from, for entropy_bound), at least `floor`; tied when
    the cut is an exact tie."""
    masked = active.nonzero().flatten().tolist()
    entropy = None
    if decoding == "entropy_bound":
        entropy = {i: float(-(dist[i] * torch.log(dist[i])).nan_to_num().sum()) for i in masked}
    keys, n = parallel_selection(decoding, masked, {i: p[i] for i in masked}, entropy, floor,
                                 threshold=threshold, **params)
    ranked = torch.full((len(p),), float("-inf"), dtype=torch.float64 if decoding == "hierarchy" else p.dtype)
    for i in masked:
        ranked[i] = keys[i]
    chosen = torch.zeros(len(p), dtype=torch.bool)
    chosen[ranked.topk(n).indices] = True
    return chosen, int(cut_is_tied(ranked, n))


def _pick(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None, draws, mask_id: int):
    """(token, probability, distribution) per row: the argmax at T == 0 (probability
    under the plain softmax, the distribution), else a draw from the tempered, top-k
    then top-p filtered distribution (inverse CDF with the given float64 uniforms).
    The plugin's one departure from the references: the mask id is never the token
    (the references' loop with editing need not end when a model keeps predicting
    it); its probability still counts."""
    if temperature == 0:
        tokens = logits.masked_fill(torch.arange(logits.shape[1]) == mask_id, float("-inf")).argmax(-1)
        probs = torch.softmax(logits, -1)
        return tokens, probs.gather(1, tokens[:, None]).squeeze(1), probs
    scaled = logits.double() / temperature
    if top_k:
        kth = scaled.topk(top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        ordered, order = scaled.sort(dim=-1, descending=True)
        cumulative = torch.softmax(ordered, -1).cumsum(-1)
        drop = cumulative > top_p
        drop[:, 1:] = drop[:, :-1].clone()
        drop[:, 0] = False
        scaled = scaled.scatter(1, order, ordered.masked_fill(drop, float("-inf")))
    probs = torch.softmax(scaled, -1)
    cdf = probs.masked_fill(torch.arange(probs.shape[1]) == mask_id, 0.0).cumsum(-1)
    tokens = torch.tensor([int((cdf[r] > draws[r] * cdf[r, -1]).nonzero()[0]) for r in range(len(probs))])
    return tokens, probs.gather(1, tokens[:, None]).squeeze(1).float(), probs


def llada2_generate(
    model: Llada2Oracle,
    prompt: list[int],
    *,
    gen_length: int,
    mask_id: int,
    eos_id: int,
    block_length: int = 32,
    steps: int = 32,
    threshold: float = 0.95,
    minimal_topk: int = 1,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    editing_threshold: float | None = None,
    max_post_steps: int = 16,
    num_to_transfer: int = 1,
    seed: int = 0,
    decoding: str = "fixed",
    commit_logits: dict | None = None,
    edit_log: list | None = None,
    iter_smooth: bool = False,
    smooth_weight: float = 0.3,
    smooth_threshold_decay: float = 0.02,
    **rule_params: float,
) -> Llada2Result:
    """LLaDA2.0's generate (editing_threshold None) or LLaDA2.1's (set).  Draws at
    T > 0 follow the plugin's random-stream contract (tests/oracle_model.py): stream 1,
    keyed by the request's global step and the canvas position (position - prompt).

    decoding != "fixed": a parallel rule (threshold, factor, entropy_bound, hierarchy,
    credit; `rule_params` its parameters, `threshold` the one above) chooses a step's
    masks instead of the official threshold-or-quota choice: LLaDA's reference
    selection (tests/oracle_rules.py), at least the official count (the 2.0 quota of the
    step; 2.1's num_to_transfer), among the active block's masks only.  Everything
    else is unchanged: the block's end (2.0: no masks, or `steps` steps), 2.1's edits
    of committed positions (plain logits: credit fuses the masked rows only) and its
    post steps.  Credit is dInfer's dense [position, vocabulary] matrix, per block.

    `commit_logits`, if given, receives per canvas position the model's logits at
    the step that last wrote it (a commit or an edit).  With `edit_log`, each edit
    appends (canvas position, token before, token after).

    iter_smooth (dInfer's IterationSmooth over the active block): after step t each
    masked generated position of the block enters step t + 1 as its token's embedding
    plus w * softmax(logits) @ embedding, w = min(0.15 + 0.02 t, smooth_weight), while
    it stays masked; the threshold (the official rule's or a parallel rule's) is
    max(1 - smooth_threshold_decay * t, threshold)."""
    from tests.oracle_rules import credit_fuse, parallel_parameters
    from tests.oracle_model import STREAM_LLADA_SAMPLE, uniform64

    _, factor, gamma, low_threshold, credit_alpha, credit_decay, credit_boost, max_tokens_per_step = (
        parallel_parameters(rule_params)
    )
    rule = dict(factor=factor, gamma=gamma, low_threshold=low_threshold, max_tokens_per_step=max_tokens_per_step)
    credit = None

    def masks_to_commit(logits, active, floor, draws):
        """(x0, p, chosen masks, tied) of a step: the official choice, or the rule's."""
        if decoding == "credit":
            for i in active.nonzero().flatten().tolist():
                logits[i] = credit_fuse(credit[i], logits[i], credit_alpha=credit_alpha, credit_decay=credit_decay,
                                        credit_boost=credit_boost)
        x0, p, dist = _pick(logits, temperature, top_k, top_p, draws, mask_id)
        step_threshold = threshold
        if iter_smooth and smooth_threshold_decay > 0:
            step_threshold = max(1 - smooth_threshold_decay * global_step, threshold)
        if decoding == "fixed":
            return (x0, p, *_masks_to_commit(p, active, step_threshold, floor))
        return (x0, p, *_rule_masks(decoding, p, dist, active, floor, threshold=step_threshold, **rule))

    P = len(prompt)
    B = block_length
    num_blocks = -(-(P + gen_length) // B)
    total = num_blocks * B
    mask = block_causal_mask(total, B)
    x = torch.full((total,), mask_id, dtype=torch.long)
    x[:P] = torch.tensor(prompt)
    steps = max(1, min(steps, gen_length // minimal_topk))
    base, extra = divmod(B, steps)
    schedule = [base + (i < extra) for i in range(steps)]
    ties = forwards = blocks = edits = 0
    global_step = 0
    # After each forward: the end of the committed prefix, and of the ended blocks.
    committed_to, ended_to = [], []

    def record(ended_before: int):
        masked = (x[P:] == mask_id).nonzero()
        committed_to.append(P + int(masked[0]) if len(masked) else total)
        ended_to.append(ended_before)

    soft = torch.zeros(total, model.embed.shape[1]) if iter_smooth else None

    def step_logits(end):
        nonlocal forwards, raw, soft
        forwards += 1
        if iter_smooth:
            extra = torch.where((x[:end] == mask_id)[:, None], soft[:end], 0.0)
            logits = model.forward(x[:end], mask[:end, :end], extra)[end - B:end]
            weight = min(0.15 + 0.02 * global_step, smooth_weight)
            soft = torch.zeros_like(soft)
            for i in range(B):
                if end - B + i >= P and int(x[end - B + i]) == mask_id:
                    soft[end - B + i] = weight * (torch.softmax(logits[i], -1) @ model.embed.float())
        else:
            logits = model.forward(x[:end], mask[:end, :end])[end - B:end]
        raw = logits.clone()
        return logits

    raw = None

    def keep_logits(start, written):
        if commit_logits is not None:
            for i in written.nonzero().flatten().tolist():
                if start + i >= P:
                    commit_logits[start + i - P] = raw[i]

    def draws_for(block_start):
        if temperature == 0:
            return None
        # Rows left of the prompt's end are never committed: any draw will do there.
        return [float(uniform64(seed, global_step, max(block_start + i - P, 0), STREAM_LLADA_SAMPLE)[0]) for i in range(B)]

    for b in range(P // B, num_blocks):
        blocks += 1
        start, end = b * B, (b + 1) * B
        credit = None
        if editing_threshold is None:
            for step in range(steps):
                active = x[start:end] == mask_id
                if not active.any():
                    break
                logits = step_logits(end)
                if credit is None:
                    credit = torch.zeros(B, logits.shape[1])
                x0, p, chosen, tied = masks_to_commit(logits, active, schedule[step], draws_for(start))
                global_step += 1
                ties += tied
                if temperature == 0:
                    ties += sum(_argmax_tied(logits[i]) for i in chosen.nonzero().flatten().tolist())
                x[start:end] = torch.where(chosen, x0, x[start:end])
                keep_logits(start, chosen)
                record(start)
        else:
            post_steps = 0
            while True:
                old = x[start:end].clone()
                active = old == mask_id
                if not active.any():
                    post_steps += 1
                if post_steps > max_post_steps:
                    break
                generated = torch.arange(start, end) >= P
                logits = step_logits(end)
                if credit is None:
                    credit = torch.zeros(B, logits.shape[1])
                x0, p, m2t, tied = masks_to_commit(logits, active, num_to_transfer, draws_for(start))
                global_step += 1
                ties += tied
                editable = ~active & generated
                t2t = editable & (p > editing_threshold) & (x0 != old)
                if temperature == 0:
                    ties += sum(_argmax_tied(logits[i]) for i in (m2t | editable).nonzero().flatten().tolist())
                edits += int(t2t.sum())
                if edit_log is not None:
                    edit_log.extend((start + i - P, int(old[i]), int(x0[i])) for i in t2t.nonzero().flatten().tolist())
                x[start:end] = torch.where(m2t | t2t, x0, old)
                keep_logits(start, m2t | t2t)
                record(start)
                if not active.any() and not t2t.any():
                    break
        if ended_to:
            ended_to[-1] = end  # the block's last forward ended it
        if (x[P:end] == eos_id).any():
            break
    answer = x[P:P + gen_length].tolist()
    if eos_id in answer:
        answer = answer[: answer.index(eos_id) + 1]
    # A server returns the tokens once they are final and stops there: without
    # editing a committed token is final once everything left of it is committed;
    # with editing only when its block has ended.  The reference may run on after
    # that (the canvas's padding, blocks after an EOS) without changing them.
    final_to = ended_to if editing_threshold is not None else committed_to
    forwards_to_output = next(f + 1 for f, reach in enumerate(final_to) if reach >= P + len(answer))
    return Llada2Result(tokens=answer, ties=ties, forwards=forwards, forwards_to_output=forwards_to_output,
                        blocks=blocks, edits=edits)
