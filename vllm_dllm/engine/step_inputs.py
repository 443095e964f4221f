"""Step inputs for a whole batch, built with a constant number of tensor ops.

The host knows each sequence's query range (from the phases), so the packed layout
is computed on the host (numpy, over small per-sequence arrays), copied to the device
once, and expanded there into per-row indices: token ids, positions, pool slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_dllm.attention.metadata import AttentionMetadata, QueryGroup


@dataclass
class SequenceLayout:
    """Host (numpy int64) arrays, one entry per sequence of the step (a request, or
    its CFG twin)."""

    slot: np.ndarray  # request slot
    twin: np.ndarray  # bool: the unconditional copy of a CFG request
    query_start: np.ndarray  # first query position
    num_queries: np.ndarray
    seq_len: np.ndarray
    kv_start: np.ndarray  # logical offset in the slot's block table (twin: after the first copy)


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    query_start_loc: torch.Tensor  # int64 [S + 1], device
    query_start: torch.Tensor  # first query position per sequence, device


def build_step_inputs(
    layout: SequenceLayout,
    *,
    prompt_tokens: torch.Tensor,  # [capacity, max_len] device
    prompt_len: torch.Tensor,  # [capacity] device
    canvas: torch.Tensor,  # [capacity, max_gen] device
    block_table: torch.Tensor,  # [capacity, max_blocks] int32 device
    block_size: int,
    mask_id: int,
    backend,
) -> StepInputs:
    device = canvas.device
    num_seqs = len(layout.slot)
    cu = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(layout.num_queries, out=cu[1:])
    max_query_len = int(layout.num_queries.max())
    max_seq_len = int(layout.seq_len.max())
    query_seq = np.repeat(np.arange(num_seqs), layout.num_queries)
    query_row = np.arange(len(query_seq)) - cu[query_seq]
    positions = layout.query_start[query_seq] + query_row

    # One host-to-device copy of everything per-row and per-sequence.
    per_seq = np.stack([layout.slot, layout.twin, layout.query_start, layout.seq_len, layout.kv_start]).astype(np.int64)
    host_query_seq, host_query_row = query_seq, query_row
    per_row = np.stack([query_seq, query_row, positions])
    per_seq, per_row, cu = (to_device(t, device) for t in (per_seq, per_row, cu))
    slot, twin, query_start, seq_len, kv_start = per_seq
    query_seq, query_row, positions = per_row

    tables = block_table[slot].long()
    row_slot = slot[query_seq]
    logical = kv_start[query_seq] + positions
    query_slots = tables[query_seq, logical // block_size] * block_size + logical % block_size

    row_prompt_len = prompt_len[row_slot]
    in_prompt = positions < row_prompt_len
    from_prompt = prompt_tokens[row_slot, positions.clamp(max=prompt_tokens.shape[1] - 1)]
    from_prompt = torch.where(twin[query_seq].bool(), mask_id, from_prompt)
    from_canvas = canvas[row_slot, (positions - row_prompt_len).clamp(min=0, max=canvas.shape[1] - 1)]
    input_ids = torch.where(in_prompt, from_prompt, from_canvas)

    metadata = AttentionMetadata(
        query_start_loc=cu.int(),
        seq_lens=seq_len.int(),
        kv_start=kv_start.int(),
        block_table=tables.int(),
        query_slots=query_slots,
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        groups=query_groups(layout, host_query_seq, host_query_row, tables, block_size),
        backend=backend,
        has_kv_offset=bool(layout.kv_start.any()),
    )
    return StepInputs(input_ids, positions, metadata, cu, query_start)


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
    )
