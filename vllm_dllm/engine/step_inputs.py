"""Step inputs for a whole batch, built with a constant number of tensor ops.

The host knows each sequence's query range (from the phases), so the packed layout
is computed on the host (numpy, over small per-sequence arrays), copied to the device
once, and expanded there into per-row indices: token ids, positions, pool slots.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch

from vllm_dllm.attention.metadata import AttentionMetadata, QueryGroup
from vllm_dllm.attention.sparse import CacheFill


@dataclass
class SequenceLayout:
    """Host (numpy int64) arrays, one entry per sequence of the step (a request, or
    its CFG twin)."""

    slot: np.ndarray  # request slot
    twin: np.ndarray  # bool: the unconditional copy of a CFG request
    query_start: np.ndarray  # first query position
    num_queries: np.ndarray
    seq_len: np.ndarray  # KV positions its queries attend (a sparse Reuse: kept + span)
    kv_start: np.ndarray  # logical offset in the slot's block table (twin: after the first copy)
    # Logical slot of the first query, after kv_start; None: its position (dense
    # storage).  A sparse Reuse writes its queries after the kept slots.
    slot_start: np.ndarray | None = None
    # bool: reads the canvas of the request's last Refresh (rebuilding an evicted
    # cache) instead of the current one; None: no sequence does.
    rebuild: np.ndarray | None = None

    def take(self, index) -> "SequenceLayout":
        return SequenceLayout(**{
            f.name: None if getattr(self, f.name) is None else getattr(self, f.name)[index] for f in fields(self)
        })

    def split_blocks(self, segment: np.ndarray) -> tuple["SequenceLayout", np.ndarray]:
        """Each sequence with `segment` > 0 (block-causal: its queries are whole blocks
        of that length) becomes one sequence per block, attending up to the block's
        own end; the others stay as they are.  Returns the new layout and, per old
        sequence, the index of its last piece (the active block's)."""
        pieces = np.where(segment > 0, self.num_queries // np.maximum(segment, 1), 1)
        last = np.cumsum(pieces) - 1
        if (pieces == 1).all() and not (segment > 0).any():
            return self, last
        old = np.repeat(np.arange(len(pieces)), pieces)
        within = np.arange(len(old)) - (last - pieces + 1)[old]
        split = self.take(old)
        causal = segment[old] > 0
        start = split.query_start + within * segment[old]
        split.query_start = np.where(causal, start, split.query_start)
        split.num_queries = np.where(causal, segment[old], split.num_queries)
        split.seq_len = np.where(causal, start + segment[old], split.seq_len)
        if split.slot_start is not None:
            split.slot_start = np.where(causal, start, split.slot_start)
        return split, last


@dataclass
class FillLayout:
    """Host arrays for the step's cache-filling sequences (sparse Refreshes, rebuilds
    of an evicted cache), which are the last `len(keep)` sequences of the
    SequenceLayout (attention/sparse.py)."""

    reuse_start: np.ndarray  # the Reuse queries of the active block, [start, end)
    reuse_end: np.ndarray
    keep: np.ndarray  # positions each KV head keeps (dense: the whole context)
    radius: np.ndarray  # pool_kernel // 2
    uniform: np.ndarray  # bool: one kept set for all heads
    mean_scoring: np.ndarray  # bool: rank by the mean query's logits...
    weight_scoring: np.ndarray  # bool: ...by the largest attention weight, else the largest logit
    dense: np.ndarray  # bool: every context position, at its own slot


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    query_start_loc: torch.Tensor  # int64 [S + 1], device
    query_start: torch.Tensor  # first query position per sequence, device
    # Where each row's token comes from: (from the prompt?, the prompt's token, the
    # canvas row and column), so a later step of the same layout rereads the canvas.
    token_source: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    row_rebuild: torch.Tensor | None = None  # bool per row: reads a past canvas (None: no row does)

    def read_tokens(self, canvas: torch.Tensor) -> None:
        """The input ids of the same layout over the canvas as it is now (in place: a
        captured graph reads the same buffer)."""
        in_prompt, from_prompt, row_slot, canvas_index = self.token_source
        self.input_ids.copy_(torch.where(in_prompt, from_prompt, canvas[row_slot, canvas_index]))


def build_step_inputs(
    layout: SequenceLayout,
    *,
    prompt_tokens: torch.Tensor,  # [capacity, max_len] device
    prompt_len: torch.Tensor,  # [capacity] device
    canvas: torch.Tensor,  # [capacity, max_gen] device
    snapshot: torch.Tensor | None = None,  # [capacity, max_gen]: canvases of the last Refreshes
    block_table: torch.Tensor,  # [capacity, max_blocks] int32 device
    block_size: int,
    mask_id: int,
    backend,
    fill: FillLayout | None = None,
) -> StepInputs:
    """`fill`: the last sequences fill caches (attention over their own in-flight
    K/V, then what the cache keeps stored); the metadata covers the others."""
    device = canvas.device
    num_seqs = len(layout.slot)
    cu = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(layout.num_queries, out=cu[1:])
    query_seq = np.repeat(np.arange(num_seqs), layout.num_queries)
    query_row = np.arange(len(query_seq)) - cu[query_seq]
    positions = layout.query_start[query_seq] + query_row
    slot_start = layout.query_start if layout.slot_start is None else layout.slot_start

    # One host-to-device copy of everything per-row and per-sequence.
    rebuild = np.zeros(num_seqs, dtype=bool) if layout.rebuild is None else layout.rebuild
    per_seq = np.stack([layout.slot, layout.twin, layout.query_start, layout.kv_start + slot_start,
                        rebuild]).astype(np.int64)
    host_cu, host_query_seq, host_query_row = cu, query_seq, query_row
    per_row = np.stack([query_seq, query_row, positions])
    per_seq, per_row, cu = (to_device(t, device) for t in (per_seq, per_row, cu))
    slot, twin, query_start, first_query_slot, rebuild = per_seq
    query_seq, query_row, positions = per_row

    tables = block_table[slot].long()
    row_slot = slot[query_seq]

    row_prompt_len = prompt_len[row_slot]
    in_prompt = positions < row_prompt_len
    from_prompt = prompt_tokens[row_slot, positions.clamp(max=prompt_tokens.shape[1] - 1)]
    from_prompt = torch.where(twin[query_seq].bool(), mask_id, from_prompt)
    canvas_index = (positions - row_prompt_len).clamp(min=0, max=canvas.shape[1] - 1)
    from_canvas = canvas[row_slot, canvas_index]
    row_rebuild = None
    if layout.rebuild is not None and layout.rebuild.any():
        row_rebuild = rebuild[query_seq].bool()
        from_canvas = torch.where(row_rebuild, snapshot[row_slot, canvas_index], from_canvas)
    input_ids = torch.where(in_prompt, from_prompt, from_canvas)

    pooled = num_seqs - (0 if fill is None else len(fill.keep))
    rows = int(host_cu[pooled])
    logical = first_query_slot[query_seq[:rows]] + query_row[:rows]
    query_slots = tables[query_seq[:rows], logical // block_size] * block_size + logical % block_size
    metadata = _metadata(
        layout.take(slice(0, pooled)), cu[: pooled + 1], host_query_seq[:rows], host_query_row[:rows],
        tables[:pooled], query_slots, block_size, backend,
    )
    if fill is not None:
        metadata.cache_fill = _cache_fill(
            layout.take(slice(pooled, None)), fill, host_cu[pooled:] - rows, host_query_seq[rows:] - pooled,
            host_query_row[rows:], tables[pooled:], rows, block_size, backend,
        )
    return StepInputs(input_ids, positions, metadata, cu, query_start,
                      token_source=(in_prompt, from_prompt, row_slot, canvas_index), row_rebuild=row_rebuild)


def _metadata(layout: SequenceLayout, cu: torch.Tensor, query_seq: np.ndarray, query_row: np.ndarray,
              tables: torch.Tensor, query_slots: torch.Tensor, block_size: int, backend) -> AttentionMetadata:
    device = tables.device
    empty = len(layout.slot) == 0
    return AttentionMetadata(
        query_start_loc=cu.int(),
        seq_lens=to_device(layout.seq_len, device).int(),
        kv_start=to_device(layout.kv_start, device).int(),
        block_table=tables.int(),
        query_slots=query_slots,
        query_pages=query_slots // block_size,
        query_offsets=query_slots % block_size,
        max_query_len=0 if empty else int(layout.num_queries.max()),
        max_seq_len=0 if empty else int(layout.seq_len.max()),
        build_groups=list if empty else lambda: query_groups(layout, query_seq, query_row, tables, block_size),
        backend=backend,
        has_kv_offset=bool(layout.kv_start.any()),
    )


def _cache_fill(layout: SequenceLayout, fill: FillLayout, cu: np.ndarray, query_seq: np.ndarray,
                    query_row: np.ndarray, tables: torch.Tensor, row_start: int, block_size: int,
                    backend) -> CacheFill:
    """The cache-filling sequences' in-flight attention and their selection grids
    (host index arithmetic over small arrays, one copy each)."""
    device = tables.device
    num_seqs = len(layout.slot)
    # In flight, each sequence's K/V are its own rows: no pool offset.
    own = SequenceLayout(layout.slot, layout.twin, layout.query_start, layout.num_queries,
                         layout.num_queries, np.zeros(num_seqs, dtype=np.int64))
    meta = _metadata(own, to_device(cu, device), query_seq, query_row, tables,
                     torch.empty(0, dtype=torch.long, device=device), block_size, backend)
    span = fill.reuse_end - fill.reuse_start
    context = layout.num_queries - span
    block_col = np.arange(max(int(span.max()), 1))
    block_rows = cu[:-1, None] + fill.reuse_start[:, None] + block_col
    block_valid = block_col < span[:, None]
    context_col = np.arange(max(int(context.max()), 1))
    context_pos = np.where(context_col < fill.reuse_start[:, None], context_col, context_col + span[:, None])
    context_valid = context_col < context[:, None]
    context_rows = cu[:-1, None] + np.where(context_valid, context_pos, 0)
    block_rows = np.where(block_valid, block_rows, cu[:-1, None])
    keep_seq = np.repeat(np.arange(num_seqs), fill.keep)
    keep_rank = np.arange(len(keep_seq)) - np.repeat(np.cumsum(fill.keep) - fill.keep, fill.keep)
    # A sparse cache packs rank j into slot j; a dense one keeps positions in place.
    kept_at = np.where(fill.dense[keep_seq], context_pos[keep_seq, keep_rank], keep_rank)
    logical = to_device(layout.kv_start[keep_seq] + kept_at, device)
    keep_seq_dev = to_device(keep_seq, device)
    keep_slots = tables[keep_seq_dev, logical // block_size] * block_size + logical % block_size
    return CacheFill(
        meta=meta,
        row_start=row_start,
        block_rows=to_device(block_rows, device),
        block_valid=to_device(block_valid, device),
        context_rows=to_device(context_rows, device),
        context_valid=to_device(context_valid, device),
        radius=to_device(fill.radius.astype(np.int64), device),
        max_radius=int(fill.radius.max()),
        uniform=to_device(fill.uniform.astype(bool), device),
        mean_scoring=to_device(fill.mean_scoring.astype(bool), device),
        weight_scoring=to_device(fill.weight_scoring.astype(bool), device),
        any_weight=bool(fill.weight_scoring.any()),
        dense=to_device(fill.dense.astype(bool), device),
        keep=to_device(fill.keep.astype(np.int64), device),
        max_keep=int(fill.keep.max()),
        keep_seq=keep_seq_dev,
        keep_rank=to_device(keep_rank, device),
        keep_slots=keep_slots,
    )


def query_groups(
    layout: SequenceLayout,
    query_seq: np.ndarray,
    query_row: np.ndarray,
    tables: torch.Tensor,
    block_size: int,
) -> list[QueryGroup]:
    """Sequences grouped by query count and by length, each rounded up to a power of
    two (host work on small arrays; a few copies of each group's indices)."""
    device = tables.device
    counts = layout.num_queries
    key = _log2_ceil(counts) * 64 + _log2_ceil(layout.seq_len)
    keys = np.unique(key)
    if len(keys) == 1:
        everyone = np.arange(len(counts))
        return [_group(None, everyone, query_seq, query_row, layout, everyone, tables, block_size)]
    groups = []
    for k in keys:
        members = np.flatnonzero(key == k)
        local = np.full(len(counts), -1, dtype=np.int64)
        local[members] = np.arange(len(members))
        rows = np.flatnonzero(local[query_seq] >= 0)
        groups.append(_group(to_device(rows, device), members, local[query_seq[rows]], query_row[rows],
                             layout, members, tables, block_size))
    return groups


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array)).to(device, non_blocking=True)


def _log2_ceil(values: np.ndarray) -> np.ndarray:
    return np.ceil(np.log2(np.maximum(values, 1))).astype(np.int64)


def _group(rows, members, query_seq, query_row, layout: SequenceLayout, seqs, tables, block_size) -> QueryGroup:
    device = tables.device
    counts = layout.num_queries[members]
    offset = layout.kv_start[members] % block_size  # a twin starts inside its first block
    first_block = layout.kv_start[members] // block_size
    length = layout.seq_len[members]
    num_blocks = int(((offset + length + block_size - 1) // block_size).max())
    block_cols = np.minimum(first_block[:, None] + np.arange(num_blocks), tables.shape[1] - 1)
    columns = np.arange(num_blocks * block_size)
    valid = (columns >= offset[:, None]) & (columns < (offset + length)[:, None])
    index = to_device(np.stack([query_seq, query_row]), device)
    seq_index = to_device(members, device)
    return QueryGroup(
        rows=rows,
        seq_index=seq_index,
        query_seq=index[0],
        query_row=index[1],
        max_query_len=int(counts.max()),
        uniform=bool((counts == counts[0]).all()),
        kv_blocks=tables[seq_index].gather(1, to_device(block_cols, device)),
        kv_valid=to_device(valid, device),
        dense_keys=_dense_keys(offset, length),
        keys_are_queries=bool(((layout.query_start[members] == 0) & (counts == length)).all()
                              and (length == length[0]).all()),
    )


def _dense_keys(offset: np.ndarray, length: np.ndarray) -> tuple[int, int] | None:
    if (offset == offset[0]).all() and (length == length[0]).all():
        return int(offset[0]), int(offset[0] + length[0])
    return None
