"""Packing the sequences of one step into a varlen batch (pure tensor code)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_dllm.attention.context import AttentionContext, SequenceSlice


def slots_for(block_ids: list[int], block_size: int, start: int, length: int) -> torch.Tensor:
    """Paged-pool slots of token indices start..start+length-1 of a request's blocks."""
    index = torch.arange(start, start + length)
    blocks = torch.tensor(block_ids, dtype=torch.long)[index // block_size]
    return blocks * block_size + index % block_size


@dataclass
class PackedSequence:
    tokens: torch.Tensor  # the full sequence, [seq_len]
    query_positions: torch.Tensor  # which positions are queries this step
    kv_slots: torch.Tensor  # slot of every position
    write_kv: bool = True


@dataclass
class PackedBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    context: AttentionContext
    query_starts: list[int]  # first packed row of each sequence


def pack(sequences: list[PackedSequence], device: torch.device) -> PackedBatch:
    ids, positions, slices, starts = [], [], [], []
    row = 0
    for seq in sequences:
        n = len(seq.query_positions)
        ids.append(seq.tokens[seq.query_positions])
        positions.append(seq.query_positions)
        slices.append(
            SequenceSlice(
                query_start=row,
                query_end=row + n,
                query_positions=seq.query_positions.to(device),
                kv_slots=seq.kv_slots.to(device),
                write_kv=seq.write_kv,
            )
        )
        starts.append(row)
        row += n
    return PackedBatch(
        input_ids=torch.cat(ids).to(device),
        positions=torch.cat(positions).to(device),
        context=AttentionContext(slices),
        query_starts=starts,
    )
