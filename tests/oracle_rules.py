"""Independent test oracle for LLaDA and Dream, the pieces their reference loops share
(tests/oracle.py: LLaDA `generate`; tests/oracle_dream.py: Dream
`diffusion_generate`; tests/oracle_llada2.py reuses the rules): results and exact-tie
detection, inverse-CDF draws, the KV-cache policies' phases and sparse selection, and
the parallel decoding rules from their published definitions.  Shares no code with
the `vllm_dllm` plugin.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tests import sparse_reference

CACHE_POLICIES = ("none", "prefix", "dual", "sparse", "vicinity")

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


def cut_is_tied(conf: torch.Tensor, k: int) -> bool:
    """True when the k-th and (k+1)-th largest finite values of conf are equal."""
    if k <= 0 or k >= conf.numel():
        return False
    ordered = torch.sort(conf, descending=True).values
    return bool(ordered[k] > -math.inf and ordered[k - 1] == ordered[k])


def max_is_tied(row: torch.Tensor) -> bool:
    return bool((row == row.max()).sum() > 1)


def inverse_cdf(probs: torch.Tensor, u: float) -> int:
    cdf = torch.cumsum(probs.double(), 0)
    above = (cdf > u * cdf[-1]).nonzero()
    return int(above[0]) if len(above) else len(cdf) - 1



def is_refresh_step(k: int, has_cache: bool, refresh_interval: int, delay_step: int) -> bool:
    """Does step k (0-based, within its block) run a Refresh (else a Reuse)?"""
    # Sparse-dLLM's delayed update: steps 0..delay_step of a block run in full.
    if not has_cache or k <= delay_step:
        return True
    return refresh_interval > 0 and k > delay_step and (k - delay_step) % refresh_interval == 0


def reuse_query_range(cache: str, prompt_len: int, gen_length: int, block: int, block_length: int,
                      vicinity: int = 0) -> tuple[int, int]:
    """[lo, hi): the absolute query positions of a Reuse step in `block` (vicinity: the
    block and `vicinity` positions on each side, within the sequence)."""
    lo = prompt_len + block * block_length
    if cache == "prefix":
        return lo, prompt_len + gen_length
    if cache in ("dual", "sparse"):
        return lo, lo + block_length
    if cache == "vicinity":
        return max(lo - vicinity, 0), min(lo + block_length + vicinity, prompt_len + gen_length)
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
