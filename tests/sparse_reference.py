"""A plain reference of the head-centric sparse KV step, written from the definition
(dLLM-Serve 4.5, Sparse-dLLM's Algorithm 1), sharing no code with the plugin:

  score   per KV head h, context position c: the q . k_c logits of the Reuse
          queries (post-RoPE) of the query heads that share KV head h, the largest
          of them (`max`), their mean (`mean`: the mean query's logit), or the
          largest log attention weight (`weight`: log softmax over the context
          positions of a query's scaled logits);
  pool    MaxPool1D over the context positions in position order (block left out),
          kernel s, stride 1, padding s // 2;
  top-k   keep = ceil(retention x context) best per head by its pooled score plus
          the mean of all heads' (`head`), or by the pooled scores summed over heads
          for all (`uniform`); scores compared at bfloat16 precision, ties: the lower
          position;
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
                   pool_kernel: int, selection: str, scoring: str = "max", scale: float | None = None
                   ) -> list[list[int]]:
    """q_block[Hq, b, D] (the Reuse queries), k_all[H_kv, L, D]: per KV head, the kept
    positions (ascending).  `scale`: the attention's, for weight scoring (default
    1 / sqrt(D))."""
    num_kv_heads, seq_len, _ = k_all.shape
    group = q_block.shape[0] // num_kv_heads
    context = [p for p in range(seq_len) if not lo <= p < hi]
    keep = kept_count(retention, len(context))
    pooled = []
    for h in range(num_kv_heads):
        queries = q_block[h * group:(h + 1) * group].double().flatten(0, 1)  # [group x b, D]
        if scoring == "mean":
            scores = torch.stack([queries.mean(dim=0) @ k_all[h, c].double() for c in context])
        elif scoring == "weight":
            logits = torch.stack([k_all[h, c].double() for c in context]) @ queries.T  # [context, queries]
            scale = scale if scale is not None else 1 / math.sqrt(queries.shape[-1])
            scores = torch.log_softmax(logits * scale, dim=0).max(dim=1).values
        else:
            scores = torch.tensor([max(float(query @ k_all[h, c].double()) for query in queries) for c in context],
                                  dtype=torch.float64)
        pooled.append(F.max_pool1d(scores[None, None], pool_kernel, stride=1, padding=pool_kernel // 2)[0, 0])
    total = sum(pooled)
    if selection == "uniform":
        pooled = [total] * num_kv_heads
    else:
        pooled = [p + total / num_kv_heads for p in pooled]
    kept = []
    for h in range(num_kv_heads):
        rounded = pooled[h].float().bfloat16().float()
        ranked = sorted(range(len(context)), key=lambda i: (-float(rounded[i]), i))
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
