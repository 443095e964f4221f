"""Step inputs for a whole batch, built with a constant number of tensor ops.

The host knows each sequence's query range (from the phases), so the packed layout
is computed on the host over small per-sequence tensors, copied to the device once,
and expanded there into per-row indices: token ids, positions, pool slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_dllm.attention.metadata import AttentionMetadata


@dataclass
class SequenceLayout:
    """Host tensors, one entry per sequence of the step (a request, or its CFG twin)."""

    slot: torch.Tensor  # request slot
    twin: torch.Tensor  # bool: the unconditional copy of a CFG request
    query_start: torch.Tensor  # first query position
    num_queries: torch.Tensor
    seq_len: torch.Tensor
    kv_start: torch.Tensor  # logical offset in the slot's block table (twin: after the first copy)


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
    cu = torch.zeros(num_seqs + 1, dtype=torch.long)
    torch.cumsum(layout.num_queries, 0, out=cu[1:])
    total = int(cu[-1])
    max_query_len = int(layout.num_queries.max())
    max_seq_len = int(layout.seq_len.max())
    query_seq = torch.repeat_interleave(torch.arange(num_seqs), layout.num_queries, output_size=total)
    query_row = torch.arange(total) - cu[query_seq]
    positions = layout.query_start[query_seq] + query_row

    # One host-to-device copy of everything per-row and per-sequence.
    per_seq = torch.stack(
        [layout.slot, layout.twin.long(), layout.query_start, layout.seq_len, layout.kv_start]
    )
    per_row = torch.stack([query_seq, query_row, positions])
    per_seq, per_row, cu = (t.to(device, non_blocking=True) for t in (per_seq, per_row, cu))
    slot, twin, query_start, seq_len, kv_start = per_seq
    query_seq, query_row, positions = per_row

    tables = block_table[slot].long()
    row_slot = slot[query_seq]
    logical = kv_start[query_seq] + positions
    query_slots = tables[query_seq, logical // block_size] * block_size + logical % block_size
    columns = torch.arange(max_seq_len, device=device)
    kv_valid = columns < seq_len[:, None]
    kv_logical = kv_start[:, None] + torch.where(kv_valid, columns, 0)
    kv_slots = tables.gather(1, kv_logical // block_size) * block_size + kv_logical % block_size

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
        query_seq=query_seq,
        query_row=query_row,
        kv_slots=kv_slots,
        kv_valid=kv_valid,
        backend=backend,
    )
    return StepInputs(input_ids, positions, metadata, cu, query_start)
