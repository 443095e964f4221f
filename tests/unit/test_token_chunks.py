"""Lazy chunking's arithmetic: which rows fit a budget, and balanced chunks of a step."""

from __future__ import annotations

import pytest
from torch import nn

from vllm_dllm.models.token_chunks import balanced_chunks, limit_activations, logits_tile_bytes, rows_within


@pytest.mark.parametrize("rows", [1, 7, 8, 9, 16, 17, 100, 1023])
@pytest.mark.parametrize("max_rows", [1, 3, 8, 64])
def test_balanced_chunks_cover_the_rows_in_as_few_even_chunks_as_fit(rows, max_rows):
    chunks = balanced_chunks(rows, max_rows)
    assert chunks[0][0] == 0 and chunks[-1][1] == rows
    assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))  # contiguous, in order
    sizes = [stop - start for start, stop in chunks]
    assert max(sizes) <= max_rows and max(sizes) - min(sizes) <= 1
    assert len(chunks) == -(-rows // max_rows)  # no more chunks than the budget needs


def test_a_step_within_the_budget_is_one_chunk_and_an_empty_step_none():
    assert balanced_chunks(8, 8) == [(0, 8)]
    assert balanced_chunks(0, 8) == []
    assert balanced_chunks(10, 8) == [(0, 5), (5, 10)]  # not 8 + 2


def test_rows_within_a_budget():
    # LLaDA-8B: a 1024-row tile of its 126,464-token vocabulary bounds a bf16 FFN
    # (3 x 12,288 per token) to 7,025 tokens a chunk.
    tile = logits_tile_bytes(1024, 126464)
    assert tile == 1024 * 126464 * 4
    assert rows_within(tile, 3 * 12288 * 2) == 7025
    assert rows_within(10, 3 * 12288 * 2) == 1  # never zero rows


def test_limit_activations_reaches_every_module_that_chunks():
    class Chunks(nn.Module):
        budget = None

        def limit_activation(self, budget_bytes):
            self.budget = budget_bytes

    model = nn.Sequential(Chunks(), nn.Linear(2, 2), nn.Sequential(Chunks()))
    assert limit_activations(model, 4096) == 2
    assert [m.budget for m in model.modules() if isinstance(m, Chunks)] == [4096, 4096]
