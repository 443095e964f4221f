"""The call check's shortcut for rules without token editing agrees with the exact
final-prefix formula it replaces."""

from __future__ import annotations

import torch

from vllm_dllm.engine.call_check import CallCheck

MASK, PAD = 9, -1


def _first_mask_final(tokens: torch.Tensor, gen_length: torch.Tensor, output_length: torch.Tensor) -> torch.Tensor:
    """DecodeState.num_final inside a block: the committed prefix ends at the first mask."""
    masked = tokens == MASK
    first = torch.where(masked.any(dim=1), masked.int().argmax(dim=1), gen_length)
    return torch.minimum(first, output_length)


def test_waiting_at_masks_matches_the_final_prefix_formula():
    generator = torch.Generator().manual_seed(0)
    requests, width, seen = 6, 24, set()
    for _ in range(300):
        gen_length = torch.randint(1, width + 1, (requests,), generator=generator)
        output_length = torch.minimum(torch.randint(1, width + 1, (requests,), generator=generator), gen_length)
        # Few token ids, so that masks and stop tokens interleave; PAD past each canvas.
        tokens = torch.randint(0, MASK + 1, (requests, width), generator=generator)
        tokens = torch.where(torch.arange(width) < gen_length[:, None], tokens, PAD)
        stop_ids = torch.full((requests, 3), -1)
        stop_ids[:, 0] = torch.randint(0, MASK, (requests,), generator=generator)
        stop_ids[::2, 1] = torch.randint(0, MASK, (requests // 2,), generator=generator)
        check = CallCheck.gather(stop_ids, output_length, width)
        exact = check.waiting(tokens, _first_mask_final(tokens, gen_length, output_length))
        assert torch.equal(check.waiting_at_masks(tokens, MASK).any(dim=1), exact)
        seen.update(exact.tolist())
    assert seen == {True, False}


def test_goes_on_stops_at_a_block_end_or_when_no_one_waits():
    check = CallCheck.gather(torch.full((2, 1), -1), torch.tensor([4, 4]), 4)
    assert check.goes_on(torch.tensor([False, False]), torch.tensor([False, True]))
    assert not check.goes_on(torch.tensor([True, False]), torch.tensor([True, True]))
    assert not check.goes_on(torch.tensor([False, False]), torch.tensor([False, False]))
