"""A plain reference of the head-centric sparse KV step, written from the definition
(dLLM-Serve 4.5, Sparse-dLLM's Algorithm 1), sharing no code with the plugin:

  score   per KV head h, context position c: q_h . k_c, q_h the mean of the Reuse
          queries' (post-RoPE) query vectors over rows and over the query heads that
          share KV head h;
  pool    MaxPool1D over the context positions in position order (block left out),
          kernel s, stride 1, padding s // 2;
  top-k   keep = ceil(retention x context) best per head (`head`), or by the pooled
          scores summed over heads for all (`uniform`); ties: the lower position;
  pack    head h's kept K/V in position order (a key mask over the dense K/V here:
          attention does not depend on the keys' order);
  attend  Reuse queries over the kept K/V plus their own fresh K/V.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def kept_count(retention: float, context: int) -> int:
    return min(context, math.ceil(retention * context - 1e-9))


def kept_positions(q_block: torch.Tensor, k_all: torch.Tensor, lo: int, hi: int, retention: float,
                   pool_kernel: int, selection: str) -> list[list[int]]:
    """q_block[Hq, b, D] (the Reuse queries), k_all[H_kv, L, D]: per KV head, the kept
    positions (ascending)."""
    num_kv_heads, seq_len, _ = k_all.shape
    group = q_block.shape[0] // num_kv_heads
    context = [p for p in range(seq_len) if not lo <= p < hi]
    keep = kept_count(retention, len(context))
    pooled = []
    for h in range(num_kv_heads):
        mean_q = q_block[h * group:(h + 1) * group].double().mean(dim=(0, 1))
        scores = torch.stack([mean_q @ k_all[h, c].double() for c in context])
        pooled.append(F.max_pool1d(scores[None, None], pool_kernel, stride=1, padding=pool_kernel // 2)[0, 0])
    if selection == "uniform":
        total = sum(pooled)
        pooled = [total] * num_kv_heads
    kept = []
    for h in range(num_kv_heads):
        ranked = sorted(range(len(context)), key=lambda i: (-float(pooled[h][i]), i))
        kept.append(sorted(context[i] for i in ranked[:keep]))
    return kept


def key_mask(kept: list[list[int]], seq_len: int, lo: int, hi: int) -> torch.Tensor:
    """[H_kv, L] bool: what each head of a Reuse step sees (its kept positions and the
    queries)."""
    mask = torch.zeros(len(kept), seq_len, dtype=torch.bool)
    for h, positions in enumerate(kept):
        mask[h, positions] = True
    mask[:, lo:hi] = True
    return mask
