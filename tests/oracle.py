"""Independent test oracle for LLaDA, part two: the reference decoding loop (LLaDA
`generate`) with its KV-cache policies and parallel decoding rules
(tests/oracle_rules.py), over the forward pass and random streams of
tests/oracle_model.py.  Dream's loop is tests/oracle_dream.py.

Written from /work/shared/MODEL_SPEC.md (section 3) and the published definitions of
the parallel decoding rules; shares no code with the `vllm_dllm` plugin.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from tests.oracle_model import STREAM_LLADA_SAMPLE, STREAM_REMASK, uniform32, uniform64
from tests.oracle_rules import (
    CACHE_POLICIES,
    OracleResult,
    credit_fuse,
    cut_is_tied,
    inverse_cdf,
    is_refresh_step,
    max_is_tied,
    parallel_parameters,
    parallel_selection,
    reuse_query_range,
    sparse_key_masks,
)

def get_num_transfer_tokens(mask_index: torch.Tensor, steps: int) -> torch.Tensor:
    """mask_index[B, block] -> [B, steps]: m // steps per step, first m % steps get +1."""
    mask_num = mask_index.sum(dim=1, keepdim=True)
    base = mask_num // steps
    remainder = mask_num % steps
    num = torch.zeros(mask_num.shape[0], steps, dtype=torch.long) + base
    for row in range(mask_num.shape[0]):
        num[row, : int(remainder[row])] += 1
    return num


# --------------------------------------------------------------------------------------
# LLaDA generate (MODEL_SPEC section 3)
# --------------------------------------------------------------------------------------


def _cfg_batch(x: torch.Tensor, prompt_index: torch.Tensor, mask_id: int) -> torch.Tensor:
    """The conditional rows followed by their prompt-masked twins."""
    un_x = x.clone()
    un_x[prompt_index] = mask_id
    return torch.cat([x, un_x], dim=0)


def _cfg_combine(both: torch.Tensor, n: int, cfg_scale: float) -> torch.Tensor:
    logits, un_logits = both[:n], both[n:]
    return un_logits + (cfg_scale + 1) * (logits - un_logits)


def llada_cfg_logits(model, x: torch.Tensor, prompt_index: torch.Tensor, mask_id: int, cfg_scale: float) -> torch.Tensor:
    """Classifier-free guidance: conditional and prompt-masked rows in one batch."""
    both = model.forward(_cfg_batch(x, prompt_index, mask_id))
    return _cfg_combine(both, x.shape[0], cfg_scale)


def _full_forward(model, ids: torch.Tensor, extra: torch.Tensor | None) -> torch.Tensor:
    return model.forward(ids) if extra is None else model.forward(ids, extra)


@torch.no_grad()
def llada_generate(
    model,
    prompt_ids: list[int],
    *,
    gen_length: int,
    steps: int,
    block_length: int,
    temperature: float = 0.0,
    cfg_scale: float = 0.0,
    remasking: str = "low_confidence",
    mask_id: int,
    eos_id: int,
    eot_id: int,
    logits_eos_inf: bool = False,
    confidence_eos_eot_inf: bool = False,
    seed: int = 0,
    cache: str = "none",
    refresh_interval: int = 0,
    delay_step: int = 0,
    decoding: str = "fixed",
    sparse: dict | None = None,
    vicinity: int = 0,
    commit_logits: dict[int, torch.Tensor] | None = None,
    iter_smooth: bool = False,
    smooth_weight: float = 0.3,
    smooth_threshold_decay: float = 0.02,
    **rule_params: float,
) -> OracleResult:
    """LLaDA `generate` (MODEL_SPEC section 3) with an optional KV-cache policy and
    parallel decoding.

    cache="none": every step is a full forward (the reference).  cache="prefix"/"dual"
    (Fast-dLLM): a step is a Refresh (full forward; the per-layer post-RoPE K/V of every
    position replace the request's cache) or a Reuse (forward of the query positions only:
    "prefix" [block start, end of sequence), "dual" the current block; every other
    position's K/V come from the cache, which a Reuse leaves unchanged).  Step k of a block
    refreshes when there is no cache yet, k == delay_step, or refresh_interval > 0,
    k > delay_step and (k - delay_step) % refresh_interval == 0.  With CFG the prompt-masked
    twin runs the same phases with its own cache.  `model` needs `forward_queries` unless
    cache == "none".  cache="sparse": dual's phases, a Reuse seeing per KV head only the
    positions that head kept at the Refresh (`sparse`: retention, pool_kernel, selection).
    cache="vicinity" (dInfer): dual's phases, a Reuse also running `vicinity` positions on
    each side of the block.

    decoding != "fixed" (Fast-dLLM's threshold and factor rules, the EB-sampler's
    entropy bound): a step commits the rule's count of the block's masked positions
    (see `parallel_count`), at least the fixed schedule's count, and the block ends
    as soon as it has no masks left.

    `commit_logits`, if given, receives per canvas position the model's logits
    (after CFG, before any rule edits them) at the step that committed it.

    iter_smooth (dInfer's IterationSmooth, over the positions a step projects): after
    step t, each masked position of the block that stays masked enters step t + 1 as
    its token's embedding plus w * softmax(logits) @ embedding, w = min(0.15 + 0.02 t,
    smooth_weight), in both CFG rows; a parallel rule's threshold is
    max(1 - smooth_threshold_decay * t, threshold).
    """
    threshold, factor, gamma, low_threshold, credit_alpha, credit_decay, credit_boost, max_tokens_per_step = (
        parallel_parameters(rule_params)
    )
    assert cache in CACHE_POLICIES, f"cache must be one of {CACHE_POLICIES}"
    assert (cache == "sparse") == (sparse is not None), "sparse's parameters go with cache='sparse' only"
    assert refresh_interval >= 0, "refresh_interval must be >= 0"
    prompt_len = len(prompt_ids)
    x = torch.tensor([list(prompt_ids) + [mask_id] * gen_length], dtype=torch.long)
    prompt_index = x != mask_id
    seq_len = prompt_len + gen_length
    if cache != "none":
        # A masked prompt position would need logits that a Reuse step does not compute.
        assert mask_id not in prompt_ids, "a KV cache needs a prompt without mask tokens"

    assert gen_length % block_length == 0, "gen_length must be a multiple of block_length"
    num_blocks = gen_length // block_length
    assert steps % num_blocks == 0, "steps must be a multiple of the number of blocks"
    steps_per_block = steps // num_blocks
    assert 0 <= delay_step < steps_per_block, "delay_step must be in [0, steps_per_block)"

    ties = 0
    global_step = 0
    n_rows = 2 if cfg_scale > 0.0 else 1  # the CFG twin is a second sequence
    kv_cache = None  # per layer (K, V, q)[n_rows, H_kv, L, D] of the last Refresh
    key_masks = None  # sparse: per layer, the keys each head kept at the last Refresh
    phases: list[str] = []
    query_tokens: list[int] = []
    soft = torch.zeros(seq_len, model.embed.shape[1]) if iter_smooth else None  # IterSmooth's extra embeddings
    for block in range(num_blocks):
        block_start = prompt_len + block * block_length
        block_end = block_start + block_length
        block_mask = x[:, block_start:block_end] == mask_id
        num_transfer = get_num_transfer_tokens(block_mask, steps_per_block)

        for i in range(steps_per_block):
            mask_index = x == mask_id
            if decoding != "fixed" and not bool(mask_index[0, block_start:block_end].any()):
                break
            refresh = cache == "none" or is_refresh_step(i, kv_cache is not None, refresh_interval, delay_step)
            extra = torch.where(mask_index[0, :, None], soft, 0.0)[None].expand(n_rows, -1, -1) if iter_smooth else None
            if cache == "none":
                n_query = seq_len
                if cfg_scale > 0.0:
                    logits = _cfg_combine(_full_forward(model, _cfg_batch(x, prompt_index, mask_id), extra), 1,
                                          cfg_scale)
                else:
                    logits = _full_forward(model, x, extra).clone()
            else:
                batch = _cfg_batch(x, prompt_index, mask_id) if cfg_scale > 0.0 else x
                reuse_lo, reuse_hi = reuse_query_range(cache, prompt_len, gen_length, block, block_length, vicinity)
                if refresh:
                    lo, hi = 0, seq_len
                    out, kv_cache = model.forward_queries(batch, None, None, return_kv=True, return_q=True,
                                                          extra_embeds=extra)
                    if cache == "sparse":
                        key_masks = sparse_key_masks(kv_cache, reuse_lo, reuse_hi, sparse)
                else:
                    lo, hi = reuse_lo, reuse_hi
                    out, _ = model.forward_queries(batch, torch.arange(lo, hi), kv_cache,
                                                   key_masks=key_masks if cache == "sparse" else None,
                                                   extra_embeds=extra)
                n_query = hi - lo
                # Rows outside the queries are never masked in the current block: their
                # logits cannot matter and are left at 0.
                both = torch.zeros(batch.shape[0], seq_len, out.shape[-1], dtype=out.dtype)
                both[:, lo:hi] = out
                logits = _cfg_combine(both, 1, cfg_scale) if cfg_scale > 0.0 else both
            phases.append("refresh" if refresh else "reuse")
            query_tokens.append(n_query * n_rows)
            model_logits = logits.clone() if commit_logits is not None else None
            model_logits_for_smooth = logits.clone() if iter_smooth else None
            if logits_eos_inf:
                logits[:, :, eos_id] = -math.inf
            if decoding == "credit":
                # dInfer's credit: a dense [position, vocabulary] matrix per block.
                if i == 0:
                    credit = torch.zeros(seq_len, logits.shape[-1])
                for p in range(block_start, block_end):
                    if bool(mask_index[0, p]):
                        logits[0, p] = credit_fuse(credit[p], logits[0, p], credit_alpha=credit_alpha,
                                                   credit_decay=credit_decay, credit_boost=credit_boost)

            # Rows whose draws can matter: still masked and inside the current block.
            rows = [p for p in range(block_start, block_end) if bool(mask_index[0, p])]
            if iter_smooth:
                weight = min(0.15 + 0.02 * global_step, smooth_weight)
                soft = torch.zeros_like(soft)
                for p in rows:
                    soft[p] = weight * (F.softmax(model_logits_for_smooth[0, p], dim=-1) @ model.embed.float())

            # At T == 0 the logits object itself is the reference's "noisy" tensor.  At
            # T > 0 the token is a draw from softmax(logits / T) (the distribution of the
            # reference's Gumbel-max) by inverse CDF, and "noisy" is a separate tensor.
            if temperature == 0:
                noisy = logits
                x0 = torch.argmax(noisy, dim=-1)
            else:
                noisy = logits.clone()
                x0 = torch.argmax(logits, dim=-1)
                for p in rows:
                    probs = F.softmax(logits[0, p].double() / temperature, dim=-1)
                    x0[0, p] = inverse_cdf(probs, float(uniform64(seed, global_step, p - prompt_len, STREAM_LLADA_SAMPLE)))
            argmax_tied = {p: max_is_tied(noisy[0, p]) for p in rows} if temperature == 0 else {}

            if confidence_eos_eot_inf:
                # The reference's chained assignment `noisy[..., EOS] = logits[..., EoT] = -inf`.
                noisy[:, :, eos_id] = -math.inf
                logits[:, :, eot_id] = -math.inf

            if remasking == "low_confidence":
                probs = F.softmax(logits, dim=-1)
                x0_p = torch.gather(probs, -1, x0.unsqueeze(-1)).squeeze(-1)
            elif remasking == "random":
                x0_p = torch.zeros(x0.shape, dtype=torch.float32)
                for p in rows:
                    x0_p[0, p] = uniform32(seed, global_step, p - prompt_len, STREAM_REMASK)
            else:
                raise NotImplementedError(remasking)

            x0_p[:, block_end:] = -math.inf
            x0 = torch.where(mask_index, x0, x)
            confidence = torch.where(mask_index, x0_p, torch.tensor(-math.inf, dtype=x0_p.dtype))

            k = int(num_transfer[0, i])
            if decoding != "fixed":
                masked = [p for p in range(block_start, block_end) if bool(mask_index[0, p])]
                entropy = None
                if decoding == "entropy_bound":
                    probs = F.softmax(logits[0], dim=-1)
                    entropy = {p: float(-(probs[p] * torch.log(probs[p])).nan_to_num().sum()) for p in masked}
                step_threshold = threshold
                if iter_smooth and smooth_threshold_decay > 0:
                    step_threshold = max(1 - smooth_threshold_decay * global_step, threshold)
                keys, k = parallel_selection(
                    decoding, masked, {p: confidence[0, p] for p in masked}, entropy, k, threshold=step_threshold,
                    factor=factor, gamma=gamma, low_threshold=low_threshold, max_tokens_per_step=max_tokens_per_step)
                # Ranked in the keys' own precision: confidences (entropies) as computed,
                # hierarchy's boosted keys in float64.
                confidence = torch.full_like(confidence, -math.inf,
                                             dtype=torch.float64 if decoding == "hierarchy" else confidence.dtype)
                for p in masked:
                    confidence[0, p] = keys[p]
            if k > 0:
                _, select = torch.topk(confidence[0], k)
                ties += int(cut_is_tied(confidence[0], k))
                ties += sum(int(argmax_tied.get(int(p), False)) for p in select)
                x[0, select] = x0[0, select]
                if commit_logits is not None:
                    for p in select.tolist():
                        commit_logits[p - prompt_len] = model_logits[0, p]
            global_step += 1

    return OracleResult(
        tokens=x[0, prompt_len:].tolist(), ties=ties, steps_run=global_step, phases=phases, query_tokens=query_tokens
    )
