"""Independent test oracle for LLaDA and Dream, part two: the reference decoding loops
(LLaDA `generate`, Dream `diffusion_generate`), their KV-cache policies and parallel
decoding rules, over the forward pass and random streams of tests/oracle_model.py.

Written from /work/shared/MODEL_SPEC.md (section 3) and the published definitions of
the parallel decoding rules; shares no code with the `vllm_dllm` plugin.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tests import sparse_reference
from tests.oracle_model import (
    STREAM_FLIP,
    STREAM_LLADA_SAMPLE,
    STREAM_REMASK,
    STREAM_SAMPLE,
    STREAM_SELECT,
    uniform32,
    uniform64,
)

# --------------------------------------------------------------------------------------
# Results and helpers
# --------------------------------------------------------------------------------------


@dataclass
class OracleResult:
    tokens: list[int]  # the whole generated canvas, prompt excluded
    ties: int  # selections decided by an exact tie (top-k cut or T=0 argmax)
    steps_run: int
    # Per step "refresh" or "reuse" (both models), and the number of query positions of
    # that step's forward, the CFG twin included (LLaDA only).
    phases: list[str] = field(default_factory=list)
    query_tokens: list[int] = field(default_factory=list)


def trim_at_eos(tokens, eos_ids) -> list[int]:
    """Prefix of `tokens` up to and including the first token in `eos_ids`."""
    if isinstance(eos_ids, int):
        eos_ids = {eos_ids}
    eos_ids = set(eos_ids)
    out = []
    for tok in tokens:
        out.append(int(tok))
        if tok in eos_ids:
            break
    return out


def _cut_is_tied(conf: torch.Tensor, k: int) -> bool:
    """True when the k-th and (k+1)-th largest finite values of conf are equal."""
    if k <= 0 or k >= conf.numel():
        return False
    ordered = torch.sort(conf, descending=True).values
    return bool(ordered[k] > -math.inf and ordered[k - 1] == ordered[k])


def _max_is_tied(row: torch.Tensor) -> bool:
    return bool((row == row.max()).sum() > 1)


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


CACHE_POLICIES = ("none", "prefix", "dual", "sparse")


def is_refresh_step(k: int, has_cache: bool, refresh_interval: int, delay_step: int) -> bool:
    """Does step k (0-based, within its block) run a Refresh (else a Reuse)?"""
    # Sparse-dLLM's delayed update: steps 0..delay_step of a block run in full.
    if not has_cache or k <= delay_step:
        return True
    return refresh_interval > 0 and k > delay_step and (k - delay_step) % refresh_interval == 0


def reuse_query_range(cache: str, prompt_len: int, gen_length: int, block: int, block_length: int) -> tuple[int, int]:
    """[lo, hi): the absolute query positions of a Reuse step in `block`."""
    lo = prompt_len + block * block_length
    if cache == "prefix":
        return lo, prompt_len + gen_length
    if cache in ("dual", "sparse"):
        return lo, lo + block_length
    raise ValueError(cache)


def sparse_key_masks(kv_cache, lo: int, hi: int, sparse: dict) -> list[torch.Tensor]:
    """Per layer [rows, H_kv, L]: the keys each head of a later Reuse of queries [lo, hi)
    sees, chosen at this Refresh (tests/sparse_reference.py); `sparse` holds retention,
    pool_kernel and selection."""
    masks = []
    for k_all, _, q in kv_cache:
        seq_len = k_all.shape[2]
        masks.append(torch.stack([
            sparse_reference.key_mask(
                sparse_reference.kept_positions(q[row, :, lo:hi], k_all[row], lo, hi, **sparse), seq_len, lo, hi
            )
            for row in range(k_all.shape[0])
        ]))
    return masks


# Parallel decoding parameters and their defaults (the option defaults of the plugin).
PARALLEL_DEFAULTS = dict(threshold=0.9, factor=1.0, gamma=1.0, low_threshold=0.3, credit_alpha=0.7,
                         credit_decay=0.8, credit_boost=0.2, max_tokens_per_step=0)


def parallel_parameters(given: dict) -> tuple:
    """The parallel decoding parameters in PARALLEL_DEFAULTS' order, defaults filled in."""
    unknown = set(given) - set(PARALLEL_DEFAULTS)
    assert not unknown, f"unknown parallel decoding parameters {sorted(unknown)}"
    return tuple({**PARALLEL_DEFAULTS, **given}.values())


def parallel_count(rule: str, values: list[float], floor: int, *, threshold: float, factor: float,
                   gamma: float, max_tokens_per_step: int) -> int:
    """Positions a parallel rule commits from its block's masked positions' values
    (confidences; entropies for entropy_bound), from the published definitions:
    threshold (Fast-dLLM): every confidence >= threshold; factor (Fast-dLLM): the
    largest n with c_i >= 1 - factor / (i + 1) for all i <= n over the descending
    confidences; entropy_bound (EB-sampler): the longest ascending-entropy prefix
    whose sum is <= gamma.  At least one, at most max_tokens_per_step (> 0), never
    below the fixed schedule's `floor`."""
    if rule == "threshold":
        n = sum(v >= threshold for v in values)
    elif rule == "factor":
        ordered = sorted(values, reverse=True)
        n = 0
        while n < len(ordered) and ordered[n] >= 1 - factor / (n + 2):
            n += 1
    elif rule == "entropy_bound":
        total, n = 0.0, 0
        for v in sorted(values):
            total += v
            if total > gamma:
                break
            n += 1
    else:
        raise NotImplementedError(rule)
    n = max(n, 1)
    if max_tokens_per_step > 0:
        n = min(n, max_tokens_per_step)
    return min(max(n, floor), len(values))


def credit_fuse(credit: torch.Tensor, logits: torch.Tensor, *, credit_alpha: float, credit_decay: float,
                credit_boost: float) -> torch.Tensor:
    """dInfer's credit for one masked position, from its definition: its dense credit
    row `credit` [vocabulary] decays, the top token of softmax(logits) gains its
    probability ** credit_boost (in place), and the logits become
    logits + credit_alpha * log(1 + credit)."""
    probs = F.softmax(logits.float(), dim=-1)
    credit *= credit_decay
    credit[int(probs.argmax())] += float(probs.max()) ** credit_boost
    return logits + credit_alpha * torch.log1p(credit).to(logits.dtype)


def parallel_selection(decoding: str, masked: list[int], confidence: dict, entropy: dict | None, floor: int, *,
                       threshold: float, factor: float, gamma: float, low_threshold: float,
                       max_tokens_per_step: int) -> tuple[dict, int]:
    """(ranking key of each masked position, how many of the best-ranked commit) under
    a parallel rule, from its block's masked positions, their confidences and (for
    entropy_bound) their entropies: keys are the confidences, the negated entropies
    for entropy_bound, and for hierarchy (dInfer: runs of consecutive masked
    positions, a run's best above low_threshold, anything above threshold) the
    confidences + 4 for the selected; the count is `parallel_count`'s (hierarchy and
    credit count as threshold rules, hierarchy over its selection)."""
    if decoding == "entropy_bound":
        keys = {p: -entropy[p] for p in masked}
        values = [entropy[p] for p in masked]
    elif decoding == "hierarchy":
        conf = {p: float(confidence[p]) for p in masked}
        runs = []
        for p in masked:
            if runs and p == runs[-1][-1] + 1:
                runs[-1].append(p)
            else:
                runs.append([p])
        chosen = {p for p in masked if conf[p] > threshold}
        for run in runs:
            best = max(conf[p] for p in run)
            chosen |= {p for p in run if conf[p] == best and best > low_threshold}
        keys = {p: conf[p] + 4.0 if p in chosen else conf[p] for p in masked}
        values = [1.0] * len(chosen) + [0.0] * (len(masked) - len(chosen))
    else:
        keys = {p: float(confidence[p]) for p in masked}
        values = [keys[p] for p in masked]
    rule = {"hierarchy": "threshold", "credit": "threshold"}.get(decoding, decoding)
    k = parallel_count(rule, values, min(floor, len(masked)), threshold=1.0 if decoding == "hierarchy" else threshold,
                       factor=factor, gamma=gamma, max_tokens_per_step=max_tokens_per_step)
    return keys, k


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
    commit_logits: dict[int, torch.Tensor] | None = None,
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

    decoding != "fixed" (Fast-dLLM's threshold and factor rules, the EB-sampler's
    entropy bound): a step commits the rule's count of the block's masked positions
    (see `parallel_count`), at least the fixed schedule's count, and the block ends
    as soon as it has no masks left.

    `commit_logits`, if given, receives per canvas position the model's logits
    (after CFG, before any rule edits them) at the step that committed it.
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
            if cache == "none":
                n_query = seq_len
                if cfg_scale > 0.0:
                    logits = llada_cfg_logits(model, x, prompt_index, mask_id, cfg_scale)
                else:
                    logits = model.forward(x).clone()
            else:
                batch = _cfg_batch(x, prompt_index, mask_id) if cfg_scale > 0.0 else x
                reuse_lo, reuse_hi = reuse_query_range(cache, prompt_len, gen_length, block, block_length)
                if refresh:
                    lo, hi = 0, seq_len
                    out, kv_cache = model.forward_queries(batch, None, None, return_kv=True, return_q=True)
                    if cache == "sparse":
                        key_masks = sparse_key_masks(kv_cache, reuse_lo, reuse_hi, sparse)
                else:
                    lo, hi = reuse_lo, reuse_hi
                    out, _ = model.forward_queries(batch, torch.arange(lo, hi), kv_cache,
                                                   key_masks=key_masks if cache == "sparse" else None)
                n_query = hi - lo
                # Rows outside the queries are never masked in the current block: their
                # logits cannot matter and are left at 0.
                both = torch.zeros(batch.shape[0], seq_len, out.shape[-1], dtype=out.dtype)
                both[:, lo:hi] = out
                logits = _cfg_combine(both, 1, cfg_scale) if cfg_scale > 0.0 else both
            phases.append("refresh" if refresh else "reuse")
            query_tokens.append(n_query * n_rows)
            model_logits = logits.clone() if commit_logits is not None else None
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
                    x0[0, p] = _inverse_cdf(probs, float(uniform64(seed, global_step, p - prompt_len, STREAM_LLADA_SAMPLE)))
            argmax_tied = {p: _max_is_tied(noisy[0, p]) for p in rows} if temperature == 0 else {}

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
                keys, k = parallel_selection(
                    decoding, masked, {p: confidence[0, p] for p in masked}, entropy, k, threshold=threshold,
                    factor=factor, gamma=gamma, low_threshold=low_threshold, max_tokens_per_step=max_tokens_per_step)
                # Ranked in the keys' own precision: confidences (entropies) as computed,
                # hierarchy's boosted keys in float64.
                confidence = torch.full_like(confidence, -math.inf,
                                             dtype=torch.float64 if decoding == "hierarchy" else confidence.dtype)
                for p in masked:
                    confidence[0, p] = keys[p]
            if k > 0:
                _, select = torch.topk(confidence[0], k)
                ties += int(_cut_is_tied(confidence[0], k))
                ties += sum(int(argmax_tied.get(int(p), False)) for p in select)
                x[0, select] = x0[0, select]
                if commit_logits is not None:
                    for p in select.tolist():
                        commit_logits[p - prompt_len] = model_logits[0, p]
            global_step += 1

    return OracleResult(
        tokens=x[0, prompt_len:].tolist(), ties=ties, steps_run=global_step, phases=phases, query_tokens=query_tokens
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


def _inverse_cdf(probs: torch.Tensor, u: float) -> int:
    cdf = torch.cumsum(probs.double(), 0)
    above = (cdf > u * cdf[-1]).nonzero()
    return int(above[0]) if len(above) else len(cdf) - 1


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
        x0 = torch.tensor([_inverse_cdf(probs[r], float(draws[r])) for r in range(probs.shape[0])], dtype=torch.long)
        confidence = torch.gather(probs, -1, x0.unsqueeze(-1)).squeeze(-1)
        tied = torch.zeros(probs.shape[0], dtype=torch.bool)
    else:
        confidence, x0 = probs.max(dim=-1)
        tied = torch.tensor([_max_is_tied(probs[r]) or _max_is_tied(logits[r]) for r in range(probs.shape[0])],
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
                    ties += int(_cut_is_tied(full_conf, n))
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
