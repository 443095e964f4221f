"""Independent test oracle for Dream, part two: the reference decoding loop (Dream
`diffusion_generate`), blockwise with KV-cache policies and parallel decoding rules
(tests/oracle_rules.py), over the forward pass and random streams of
tests/oracle_model.py.

Written from /work/shared/MODEL_SPEC.md (section 3); shares no code with the
`vllm_dllm` plugin.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from tests.oracle_model import STREAM_FLIP, STREAM_SAMPLE, STREAM_SELECT, uniform32, uniform64
from tests.oracle_rules import (
    CACHE_POLICIES,
    OracleResult,
    cut_is_tied,
    inverse_cdf,
    is_refresh_step,
    max_is_tied,
    parallel_count,
    parallel_parameters,
    sparse_key_masks,
)

# --------------------------------------------------------------------------------------
# Dream _sample (MODEL_SPEC section 3)
# --------------------------------------------------------------------------------------


def top_p_logits(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_logits, sorted_indices = torch.sort(logits, descending=True)
    cumulative = torch.cumsum(F.softmax(sorted_logits, dim=-1), dim=-1)
    remove_sorted = cumulative > top_p
    remove_sorted[..., 1:] = remove_sorted[..., :-1].clone()  # keep the first over the line
    remove_sorted[..., 0] = False
    remove = torch.zeros_like(logits, dtype=torch.bool).scatter(-1, sorted_indices, remove_sorted)
    return logits.masked_fill(remove, torch.finfo(logits.dtype).min)


def top_k_logits(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    top_k = min(top_k, logits.shape[-1])
    kth = torch.topk(logits, top_k).values[..., -1, None]
    return logits.masked_fill(logits < kth, torch.finfo(logits.dtype).min)


def dream_sample_tokens(
    logits: torch.Tensor,
    temperature: float = 0.0,
    top_p: float | None = None,
    top_k: int | None = None,
    margin_confidence: bool = False,
    neg_entropy: bool = False,
    draws: torch.Tensor | None = None,
):
    """logits[M, V] -> (confidence[M], x0[M], argmax_tied[M] (only meaningful at T == 0))."""
    if temperature > 0:
        logits = logits / temperature
    if top_p is not None and top_p < 1:
        logits = top_p_logits(logits, top_p)
    if top_k is not None and top_k > 0:
        logits = top_k_logits(logits, top_k)
    probs = torch.softmax(logits, dim=-1)

    if temperature > 0:
        assert draws is not None and len(draws) == probs.shape[0]
        # Inverse CDF: the first id whose cumulative probability exceeds u * total.
        x0 = torch.tensor([inverse_cdf(probs[r], float(draws[r])) for r in range(probs.shape[0])], dtype=torch.long)
        confidence = torch.gather(probs, -1, x0.unsqueeze(-1)).squeeze(-1)
        tied = torch.zeros(probs.shape[0], dtype=torch.bool)
    else:
        confidence, x0 = probs.max(dim=-1)
        tied = torch.tensor([max_is_tied(probs[r]) or max_is_tied(logits[r]) for r in range(probs.shape[0])],
                            dtype=torch.bool)

    if margin_confidence:
        sorted_probs = torch.sort(probs, dim=-1, descending=True).values
        confidence = sorted_probs[:, 0] - sorted_probs[:, 1]
    if neg_entropy:
        confidence = torch.sum(probs * torch.log(probs + 1e-10), dim=-1)
    return confidence, x0, tied


@torch.no_grad()
def dream_generate(
    model,
    prompt_ids: list[int],
    *,
    max_new_tokens: int,
    steps: int,
    eps: float = 1e-3,
    alg: str = "origin",
    alg_temp: float | None = None,
    temperature: float = 0.0,
    top_p: float | None = None,
    top_k: int | None = None,
    mask_id: int,
    seed: int = 0,
    decoding: str = "fixed",
    block_length: int | None = None,
    cache: str = "none",
    refresh_interval: int = 0,
    delay_step: int = 0,
    sparse: dict | None = None,
    commit_logits: dict[int, torch.Tensor] | None = None,
    **rule_params: float,
) -> OracleResult:
    """Dream `diffusion_generate`; decoding != "fixed" commits a parallel rule's count
    of the masked positions (`parallel_count`, at least the schedule's count) and
    stops as soon as the canvas has no masks left.  `credit` keeps dInfer's dense
    per-token credit over the whole canvas (one block) and adds
    credit_alpha * log(1 + credit) to the raw logits.

    block_length: the canvas decoded block by block, Dream's rule and schedule (over
    steps / blocks steps) within each block; cache prefix/dual/sparse as for LLaDA, a
    Reuse also running the position before the block (its row predicts the block's
    first position).  `commit_logits`: as for llada_generate (the row before each
    position, Dream's shift)."""
    threshold, factor, gamma, low_threshold, credit_alpha, credit_decay, credit_boost, max_tokens_per_step = (
        parallel_parameters(rule_params)
    )
    assert cache in CACHE_POLICIES, f"cache must be one of {CACHE_POLICIES}"
    assert (cache == "sparse") == (sparse is not None), "sparse's parameters go with cache='sparse' only"
    prompt_len = len(prompt_ids)
    assert mask_id not in prompt_ids
    x = torch.tensor([list(prompt_ids) + [mask_id] * max_new_tokens], dtype=torch.long)
    num_blocks = max_new_tokens // (block_length or max_new_tokens)
    steps_per_block = steps // num_blocks
    block_length = max_new_tokens // num_blocks
    timesteps = torch.linspace(1, eps, steps_per_block + 1)
    seq_len = prompt_len + max_new_tokens
    kv_cache = None  # per layer (K, V, q) of the last Refresh
    key_masks = None  # sparse: per layer, the keys each head kept at the last Refresh
    phases: list[str] = []
    ties = 0

    steps_run = 0
    for block in range(num_blocks):
        block_start = prompt_len + block * block_length
        block_end = block_start + block_length
        for k in range(steps_per_block):
            mask_index = x == mask_id
            mask_index[:, :block_start] = False
            mask_index[:, block_end:] = False
            if decoding != "fixed" and not bool(mask_index.any()):
                break
            i = steps_run  # the step's index over the whole request (the draws' key)
            steps_run += 1
            refresh = cache == "none" or is_refresh_step(k, kv_cache is not None, refresh_interval, delay_step)
            if cache == "none":
                logits = model.forward(x)
            elif refresh:
                logits, kv_cache = model.forward_queries(x, None, None, return_kv=True, return_q=True)
                if cache == "sparse":
                    key_masks = sparse_key_masks(kv_cache, block_start - 1, block_end, sparse)
            else:
                # Position j is predicted from row j - 1: the row before the block too.
                lo = block_start - 1
                hi = seq_len if cache == "prefix" else block_end
                out, _ = model.forward_queries(x, torch.arange(lo, hi), kv_cache,
                                               key_masks=key_masks if cache == "sparse" else None)
                logits = torch.zeros(1, seq_len, out.shape[-1], dtype=out.dtype)
                logits[:, lo:hi] = out
            phases.append("refresh" if refresh else "reuse")
            logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)  # position j predicted by row j-1
            mask_logits = logits[mask_index]  # [M, V], rows in canvas order
            canvas_pos = mask_index[0].nonzero().squeeze(-1) - prompt_len  # [M]
            model_logits = mask_logits.clone() if commit_logits is not None else None
            if decoding == "credit":
                if k == 0:
                    credit = torch.zeros(max_new_tokens, mask_logits.shape[-1])
                for row, p in enumerate(canvas_pos.tolist()):
                    probs = F.softmax(mask_logits[row].float(), dim=-1)
                    credit[p] *= credit_decay
                    credit[p, int(probs.argmax())] += float(probs.max()) ** credit_boost
                    mask_logits[row] = mask_logits[row] + credit_alpha * torch.log1p(credit[p]).to(mask_logits.dtype)
            t, s = timesteps[k], timesteps[k + 1]

            def sample_draws(positions):
                return torch.cat([uniform64(seed, i, int(p), STREAM_SAMPLE) for p in positions])

            if alg == "origin":
                p_transfer = 1 - s / t if k < steps_per_block - 1 else 1
                flip = torch.tensor(
                    [bool(torch.tensor(uniform32(seed, i, int(p), STREAM_FLIP)) < p_transfer)
                     for p in canvas_pos],
                    dtype=torch.bool,
                )
                x0 = torch.full((mask_logits.shape[0],), mask_id, dtype=torch.long)
                if bool(flip.any()):
                    _, chosen, tied = dream_sample_tokens(
                        mask_logits[flip], temperature, top_p, top_k,
                        draws=sample_draws(canvas_pos[flip]) if temperature > 0 else None,
                    )
                    x0[flip] = chosen
                    ties += int(tied.sum())
                x[mask_index] = x0
                if commit_logits is not None:
                    for row in flip.nonzero().flatten().tolist():
                        commit_logits[int(canvas_pos[row])] = model_logits[row]
                continue

            if alg not in ("maskgit_plus", "topk_margin", "entropy"):
                raise RuntimeError(f"Unknown alg: {alg}")
            confidence, x0, tied = dream_sample_tokens(
                mask_logits, temperature, top_p, top_k,
                margin_confidence=alg == "topk_margin",
                neg_entropy=alg == "entropy" or decoding == "entropy_bound",
                draws=sample_draws(canvas_pos) if temperature > 0 else None,
            )
            num_mask_token = mask_index.sum() / mask_index.shape[0]  # float32 tensor
            if k < steps_per_block - 1:
                n = int(num_mask_token * (1 - s / t))
            else:
                n = int(num_mask_token)
            if decoding != "fixed":
                values = [-float(c) if decoding == "entropy_bound" else float(c) for c in confidence]
                n = parallel_count("threshold" if decoding == "credit" else decoding, values, min(n, len(values)),
                                   threshold=threshold, factor=factor, gamma=gamma,
                                   max_tokens_per_step=max_tokens_per_step)

            # Confidence over the canvas only: -inf where the canvas is already decided.
            full_conf = torch.full((max_new_tokens,), -math.inf, dtype=logits.dtype)
            full_conf[canvas_pos] = confidence.to(logits.dtype)
            proposal = torch.full((max_new_tokens,), mask_id, dtype=torch.long)
            proposal[canvas_pos] = x0
            tied_at = torch.zeros(max_new_tokens, dtype=torch.bool)
            tied_at[canvas_pos] = tied

            if n > 0:
                if alg_temp is None or alg_temp == 0:
                    _, select = torch.topk(full_conf, n)
                    ties += int(cut_is_tied(full_conf, n))
                else:
                    # Gumbel-top-k over confidence / alg_temp: multinomial without replacement.
                    u = torch.cat([uniform64(seed, i, p, STREAM_SELECT) for p in range(max_new_tokens)])
                    keys = (full_conf / alg_temp).double() - torch.log(-torch.log(u))
                    _, select = torch.topk(keys, n)
                ties += int(tied_at[select].sum())
                x[0, prompt_len + select] = proposal[select]
                if commit_logits is not None:
                    row_of = {int(p): row for row, p in enumerate(canvas_pos.tolist())}
                    for p in select.tolist():
                        commit_logits[p] = model_logits[row_of[p]]

    return OracleResult(tokens=x[0, prompt_len:].tolist(), ties=ties, steps_run=steps_run, phases=phases)
