"""Head-centric sparse KV: which context positions each KV head keeps, and packing
them densely into the request's own pool slots.  Imports no vLLM.

At a sparse request's Refresh (dLLM-Serve 4.5; Sparse-dLLM's selection per head):

  * score every context position c (every position outside the Reuse queries: the
    active block and, for a shifted model, the position before it) per KV head h from
    the q.k logits of the block's (post-RoPE) queries of the query heads sharing KV
    head h, aggregated by `scoring`: `max` takes the largest logit, so a position
    counts if any block query reads it strongly; `weight` (head-centric's default)
    takes the largest attention weight (its log: each query's log-softmax over the
    context), so a query whose logits all run high does not outrank one that reads
    a few positions sharply; `mean` scores with the mean query (the mean logit), as
    Sparse-dLLM averages its block queries.  On the shipped model, scoring by single
    queries keeps far more accuracy at low retention for both selections
    (benchmarks/results/sparse-quality): the block's positions need different
    context positions (a reversed copy, digits of a sum), and the mean query blurs
    them.  Weights beat logits for head-centric selection
    (benchmarks/results/sparse-quality-weight);
  * max-pool the scores along the context positions (in position order, the block
    left out) with window `pool_kernel`, past the ends padded with -inf as
    MaxPool1D pads (head-centric selection by default only from retention 0.4 on,
    options/sparse_defaults.py);
  * `head`: each KV head keeps its own `kept` best positions, ranked by its own
    pooled score plus the mean of every KV head's (a position all heads read counts
    for each head too: on the shipped model this keeps uniform's accuracy where a
    head's own scores alone fell behind it, benchmarks/results/sparse-pool-kernel);
    `uniform` (Sparse-dLLM) ranks by the pooled scores summed over heads and keeps
    one set for all.  Under tensor parallelism the sum covers every rank's heads
    (`HeadsOverRanks`).  Scores are ranked
    at bfloat16 precision and ties rank the lower position first (max-pooling makes
    neighbours tie exactly; masked positions tie up to rounding);
  * pack: head h's j-th kept position (in position order) goes to logical slot j of
    the sequence, head h's lane.  RoPE is already applied, so a Reuse step attends
    over slots 0..kept+span-1 with the ordinary paged kernel and keeps no index map.

The Refresh itself attends over its in-flight K/V: the pool never holds a sparse
request's whole sequence.

The same path rebuilds the cache of a request whose KV blocks were freed by
preemption when its next step is a Reuse: a sequence over the canvas of its last
Refresh attends in flight and stores what that Refresh stored (a sparse request's
kept K/V; a dense one's every position outside the Reuse queries, at its own slot),
so the Reuse that follows in the same step sees the cache it would have seen.

Everything here is tensor work over all the step's cache-filling sequences at once,
padded to the longest; the host built the index grids.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm_dllm.attention.metadata import AttentionMetadata


@dataclass(frozen=True)
class HeadsOverRanks:
    """A layer's KV heads split over tensor-parallel ranks: `count` the ranks hold
    together, and `sum` (vLLM's all-reduce) adds a tensor over the ranks."""

    count: int
    sum: Callable[[torch.Tensor], torch.Tensor]


@dataclass
class CacheFill:
    """The step's cache-filling sequences (sparse Refreshes, rebuilds of an evicted
    cache), which come after every other sequence.

    Row indices are local to their rows (packed row `row_start + i` is local row i)."""

    meta: AttentionMetadata  # attention over their own in-flight K/V
    row_start: int
    block_rows: torch.Tensor  # int64 [S, B]: the rows of each sequence's Reuse queries
    block_valid: torch.Tensor  # bool [S, B]
    context_rows: torch.Tensor  # int64 [S, C]: its context positions' rows, in position order
    context_valid: torch.Tensor  # bool [S, C]
    radius: torch.Tensor  # int64 [S]: pool_kernel // 2
    max_radius: int
    uniform: torch.Tensor  # bool [S]
    mean_scoring: torch.Tensor  # bool [S]: score with the mean query...
    weight_scoring: torch.Tensor  # bool [S]: ...with the largest attention weight, else the largest logit
    any_weight: bool  # some sequence scores by weight
    dense: torch.Tensor  # bool [S]: keeps every context position (a dense cache's rebuild)
    keep: torch.Tensor  # int64 [S]: positions kept per head
    max_keep: int
    keep_seq: torch.Tensor  # int64 [N]: (sequence, rank) of every kept slot...
    keep_rank: torch.Tensor
    keep_slots: torch.Tensor  # int64 [N]: ...and its pool slot (a dense cache: the position's own)


def context_scores(q: torch.Tensor, k: torch.Tensor, plan: CacheFill, scale: float) -> torch.Tensor:
    """[S, H_kv, C] float32: each context position's score with the block's queries,
    per KV head, aggregated over the block's rows and the query heads sharing the KV
    head: the largest logit, the largest log attention weight (weight scoring: each
    query's log-softmax of its `scale`d logits over the context), or the mean logit
    (mean scoring)."""
    num_kv_heads = k.shape[1]
    grid = q[plan.block_rows].float()  # [S, B, H, D]
    num_seqs, rows, num_heads, head_dim = grid.shape
    grid = grid.view(num_seqs, rows, num_kv_heads, num_heads // num_kv_heads, head_dim)
    keys = k[plan.context_rows].float()  # [S, C, H_kv, D]
    logits = torch.einsum("sbhgd,schd->shgbc", grid, keys)
    valid = plan.block_valid[:, None, None, :, None]
    largest = logits.masked_fill(~valid, float("-inf")).amax(dim=(2, 3))
    # The mean of the logits is the logit of the mean query (Sparse-dLLM's q-bar).
    count = plan.block_valid.sum(dim=1).clamp(min=1) * (num_heads // num_kv_heads)
    mean = (logits * valid).sum(dim=(2, 3)) / count[:, None, None]
    scores = torch.where(plan.mean_scoring[:, None, None], mean, largest)
    if not plan.any_weight:
        return scores
    inside = plan.context_valid[:, None, None, None, :]
    weights = torch.log_softmax((logits * scale).masked_fill(~inside, float("-inf")), dim=-1)
    # A row without context is all -inf and its log-softmax NaN: mask it again.
    largest_weight = weights.masked_fill(~(inside & valid), float("-inf")).amax(dim=(2, 3))
    return torch.where(plan.weight_scoring[:, None, None], largest_weight, scores)


def pooled_scores(q: torch.Tensor, k: torch.Tensor, plan: CacheFill, scale: float) -> torch.Tensor:
    """[S, H_kv, C] float32: max-pooled scores of the context positions (-inf past a
    sequence's context)."""
    scores = context_scores(q, k, plan, scale)
    outside = ~plan.context_valid[:, None, :]
    scores = scores.masked_fill(outside, float("-inf"))
    pooled = scores
    for d in range(1, plan.max_radius + 1):
        reach = (plan.radius >= d)[:, None, None]
        edge = scores.new_full((*scores.shape[:2], d), float("-inf"))
        before = torch.cat([edge, scores[..., :-d]], dim=-1)  # position c sees c - d
        after = torch.cat([scores[..., d:], edge], dim=-1)  # and c + d
        pooled = torch.where(reach, torch.maximum(pooled, torch.maximum(before, after)), pooled)
    # Padding past a sequence's context picked up its last positions' scores.
    return pooled.masked_fill(outside, float("-inf"))


def kept_context(q: torch.Tensor, k: torch.Tensor, plan: CacheFill, scale: float,
                 over_ranks: HeadsOverRanks | None = None) -> torch.Tensor:
    """[S, H_kv, max_keep] int64: each head's kept context indices, ascending; entries
    from `keep[s]` on are padding (the context length).  A dense sequence keeps all.
    `scale`: the attention's (weight scoring); `over_ranks`: the KV heads other
    tensor-parallel ranks hold (None: all are here)."""
    pooled = pooled_scores(q, k, plan, scale)
    pooled = torch.where(plan.dense[:, None, None], 0.0, pooled)  # all tie: position order
    total, count = pooled.sum(dim=1, keepdim=True), k.shape[1]
    if over_ranks is not None:
        total, count = over_ranks.sum(total), over_ranks.count
    ranking = torch.where(plan.uniform[:, None, None], total.expand_as(pooled), pooled + total / count)
    # Ranked at bfloat16 precision: positions whose scores agree to 8 significant bits
    # (mask tokens of the canvas score alike up to rounding) go in position order, so
    # rounding noise from one kernel to another does not change what is kept.
    ranking = ranking.to(torch.bfloat16).float()
    # A stable sort keeps equal scores in position order: ties go to the lower position.
    order = torch.sort(ranking, dim=-1, descending=True, stable=True).indices[..., : plan.max_keep]
    rank = torch.arange(plan.max_keep, device=order.device)
    padding = ranking.shape[-1]
    order = torch.where(rank < plan.keep[:, None, None], order, padding)
    return order.sort(dim=-1).values


def pack_kept(cache: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: CacheFill,
              scale: float, over_ranks: HeadsOverRanks | None = None) -> None:
    """Select each head's context positions and write their K/V into the sequences'
    slots 0..kept-1, head by head (q, k, v: the sparse sequences' rows)."""
    if plan.keep_seq.numel() == 0:
        return
    kept = kept_context(q, k, plan, scale, over_ranks)  # [S, H_kv, max_keep]
    num_kv_heads = k.shape[1]
    context = kept[plan.keep_seq, :, plan.keep_rank]  # [N, H_kv]
    rows = plan.context_rows[plan.keep_seq[:, None], context]  # [N, H_kv]
    heads = torch.arange(num_kv_heads, device=k.device)
    block_size = cache.shape[1]
    cache[plan.keep_slots // block_size, plan.keep_slots % block_size] = torch.stack(
        [k[rows, heads], v[rows, heads]], dim=1
    ).to(cache.dtype)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor | None,
           meta: AttentionMetadata, scale: float, over_ranks: HeadsOverRanks | None = None) -> torch.Tensor:
    """One layer's attention for a step with cache-filling sequences: they attend
    over their in-flight K/V and store what the cache keeps, then the others attend
    through the backend over the pool (a rebuilt cache's Reuse reads what was just
    stored)."""
    plan: CacheFill = meta.cache_fill
    start = plan.row_start
    out = torch.empty_like(q)
    out[start:] = meta.backend.attend(q[start:], k[start:], v[start:], None, plan.meta, scale)
    if cache is not None:
        pack_kept(cache, q[start:], k[start:], v[start:], plan, scale, over_ranks)
    if start:
        out[:start] = meta.backend.attend(q[:start], k[:start], v[:start], cache, meta, scale)
    return out
