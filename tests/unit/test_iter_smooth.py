"""IterSmooth's store (engine/iter_smooth.py) and falling threshold, on their own:
what a step keeps of its candidates' distributions, what the next forward adds and
where, and the weights and thresholds of dInfer's schedule."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.vocab_shards import run_sharded
from vllm_dllm.decoding.parallel_params import ParallelParams
from vllm_dllm.decoding.vocab import WHOLE
from vllm_dllm.engine.iter_smooth import SoftEmbeddings
from vllm_dllm.options.smoothing import smooth_weight_at

VOCAB, HIDDEN, MASK = 11, 6, 10


def options(on: bool, block: int = 4, gen: int = 8, weight: float = 0.3):
    return SimpleNamespace(iter_smooth=on, smooth_weight=weight, gen_length=gen, block_length=block)


def store(embedding: torch.Tensor, capacity: int = 3) -> SoftEmbeddings:
    return SoftEmbeddings(capacity, torch.device("cpu"), WHOLE, lambda: embedding)


def rows_of(slots, canvas_index, input_ids, in_prompt=None):
    """A step's rows as StepInputs.token_source describes them."""
    slots, canvas_index, input_ids = (torch.tensor(v) for v in (slots, canvas_index, input_ids))
    in_prompt = torch.zeros(len(slots), dtype=torch.bool) if in_prompt is None else torch.tensor(in_prompt)
    return input_ids, (in_prompt, None, slots, canvas_index)


def test_weights_grow_to_the_cap():
    assert smooth_weight_at(0, 0.3) == pytest.approx(0.15)
    assert smooth_weight_at(5, 0.3) == pytest.approx(0.25)
    assert smooth_weight_at(40, 0.3) == pytest.approx(0.3)
    steps = torch.tensor([0.0, 3.0, 100.0, 2.0])
    assert torch.allclose(smooth_weight_at(steps, torch.tensor([0.3, 0.3, 0.5, 0.0])),
                          torch.tensor([0.15, 0.21, 0.5, 0.0]))


def test_a_step_keeps_its_candidates_expected_embeddings_for_the_next_forward():
    torch.manual_seed(0)
    embedding = torch.randn(VOCAB + 2, HIDDEN)  # padded rows past the vocabulary: never read
    soft = store(embedding)
    soft.make_room(options(True))
    soft.admit(0, options(True))
    soft.make_room(options(False))
    soft.admit(1, options(False))
    logits = torch.randn(3, VOCAB)
    slots, positions = torch.tensor([0, 0, 1]), torch.tensor([4, 6, 4])
    soft.record(logits, slots, positions, steps=torch.tensor([2, 2, 2]))
    expected = 0.19 * torch.softmax(logits, dim=-1) @ embedding[:VOCAB]

    # Next step: slot 0's positions 4 (still masked), 5 (never a candidate), 6 (now
    # committed), a prompt row; slot 1's masked 4 (it does not smooth).
    input_ids, source = rows_of([0, 0, 0, 0, 1], [4, 5, 6, 0, 4], [MASK, MASK, 3, 7, MASK],
                                in_prompt=[False, False, False, True, False])
    base = torch.randn(5, HIDDEN)
    out = soft.add_to(base, input_ids, source, MASK)
    assert torch.allclose(out[0], base[0] + expected[0], atol=1e-6)
    assert torch.equal(out[1:], base[1:])
    # A row rebuilding a past canvas reads no smoothing.
    rebuilt = soft.add_to(base, input_ids, source, MASK, rebuild=torch.tensor([True, False, False, False, False]))
    assert torch.equal(rebuilt, base)


def test_the_next_block_does_not_read_the_last_blocks_entries():
    embedding = torch.randn(VOCAB, HIDDEN)
    soft = store(embedding)
    soft.make_room(options(True, block=4))
    soft.admit(0, options(True, block=4))
    assert soft.width == 4
    soft.record(torch.randn(1, VOCAB), torch.tensor([0]), torch.tensor([3]), torch.tensor([0]))
    input_ids, source = rows_of([0, 0], [3, 7], [MASK, MASK])  # 7 shares 3's entry
    base = torch.zeros(2, HIDDEN)
    out = soft.add_to(base, input_ids, source, MASK)
    assert out[0].abs().sum() > 0 and torch.equal(out[1], base[1])


def test_a_wider_block_keeps_what_is_stored_and_a_grown_batch_too():
    embedding = torch.randn(VOCAB, HIDDEN)
    soft = store(embedding, capacity=2)
    soft.make_room(options(True, block=4))
    soft.admit(0, options(True, block=4))
    soft.record(torch.randn(2, VOCAB), torch.tensor([0, 0]), torch.tensor([5, 6]), torch.tensor([1, 1]))
    input_ids, source = rows_of([0, 0], [5, 6], [MASK, MASK])
    before = soft.add_to(torch.zeros(2, HIDDEN), input_ids, source, MASK)
    soft.make_room(options(True, block=16, gen=32))
    soft.admit(1, options(True, block=16, gen=32))
    soft.grow_slots(4)
    assert soft.width == 16 and soft.lanes == 2 and len(soft.cap) == 4
    assert torch.equal(soft.add_to(torch.zeros(2, HIDDEN), input_ids, source, MASK), before)
    assert (soft.lane_of[2:] == -1).all() and soft.cap_host[2:].sum() == 0


def test_the_store_holds_a_lane_per_smoothing_request_only():
    soft = store(torch.randn(VOCAB, HIDDEN), capacity=64)
    for slot in range(64):
        soft.make_room(options(slot == 7, block=32, gen=32))
        soft.admit(slot, options(slot == 7, block=32, gen=32))
    assert soft.lanes == 1 and tuple(soft.values.shape) == (2, 32, HIDDEN)  # one lane and the untagged one
    soft.release(7)
    soft.make_room(options(True, block=32, gen=32))
    soft.admit(9, options(True, block=32, gen=32))
    assert soft.lanes == 1 and int(soft.lane_of[9]) == 0


def test_a_plain_request_in_a_smoothing_requests_old_slot_reads_nothing():
    soft = store(torch.randn(VOCAB, HIDDEN))
    soft.make_room(options(True))
    soft.admit(0, options(True))
    soft.record(torch.randn(2, VOCAB), torch.tensor([0, 0]), torch.tensor([4, 5]), torch.tensor([3, 3]))
    soft.release(0)  # the request finished; a plain one takes its slot
    soft.admit(0, options(False))
    soft.make_room(options(True))
    soft.admit(1, options(True))  # a smoothing request in the same step
    input_ids, source = rows_of([0, 0], [4, 5], [MASK, MASK])
    base = torch.randn(2, HIDDEN)
    assert torch.equal(soft.add_to(base, input_ids, source, MASK), base)


def test_a_step_reads_only_the_step_before():
    soft = store(torch.randn(VOCAB, HIDDEN))
    soft.make_room(options(True))
    soft.admit(0, options(True))
    soft.record(torch.randn(1, VOCAB), torch.tensor([0]), torch.tensor([2]), torch.tensor([0]))
    soft.clear(torch.tensor([0]))  # the next step projects nothing at position 2
    input_ids, source = rows_of([0], [2], [MASK])
    base = torch.randn(1, HIDDEN)
    assert torch.equal(soft.add_to(base, input_ids, source, MASK), base)


def test_positions_returned_to_the_mask_are_forgotten():
    soft = store(torch.randn(VOCAB, HIDDEN))
    soft.make_room(options(True, block=8))
    soft.admit(0, options(True, block=8))
    soft.record(torch.randn(3, VOCAB), torch.tensor([0, 0, 0]), torch.tensor([1, 3, 5]), torch.tensor([4, 4, 4]))
    soft.forget(torch.tensor([0]), torch.tensor([3]))
    assert sorted(t for t in soft.tags[int(soft.lane_of[0])].tolist() if t >= 0) == [1]


def test_asking_is_known_on_the_host():
    soft = store(torch.randn(VOCAB, HIDDEN))
    soft.admit(0, options(False))
    soft.make_room(options(True))
    soft.admit(2, options(True))
    assert not soft.asks(np.array([0, 1])) and soft.asks(np.array([1, 2]))


def test_a_model_without_an_input_embedding_refuses_smoothing_before_taking_a_slot():
    soft = SoftEmbeddings(2, torch.device("cpu"), WHOLE, None)
    soft.make_room(options(False))  # plain requests need nothing
    with pytest.raises(ValueError, match="needs the model's input embedding"):
        soft.make_room(options(True))


@pytest.mark.parametrize("world", [2, 3])
def test_vocabulary_shards_sum_to_the_whole_expected_embedding(world):
    torch.manual_seed(world)
    embedding, logits = torch.randn(VOCAB, HIDDEN, dtype=torch.float64), torch.randn(4, VOCAB, dtype=torch.float64)
    slots, positions = torch.tensor([0, 0, 1, 1]), torch.tensor([0, 1, 2, 3])

    def recorded(vocab, start, end):
        soft = SoftEmbeddings(2, torch.device("cpu"), vocab, lambda: embedding[start:end])
        for slot in (0, 1):
            soft.make_room(options(True))
            soft.admit(slot, options(True))
        soft.record(logits[:, start:end], slots, positions, torch.zeros(4, dtype=torch.long))
        return soft.values[soft.lane_of[slots], positions % soft.width]

    whole = recorded(WHOLE, 0, VOCAB)
    for rank_values in run_sharded(recorded, VOCAB, world):
        assert torch.allclose(rank_values, whole, atol=1e-12)


def test_a_smoothing_requests_threshold_falls_from_one():
    steps = torch.tensor([0, 3, 10, 40, 0])
    params = ParallelParams(5, torch.device("cpu"), 8, steps=lambda: steps)
    for slot, on in enumerate([True, True, True, True, False]):
        params.admit(slot, SimpleNamespace(
            decoding="threshold", threshold=0.5, factor=1.0, gamma=1.0, low_threshold=0.3, max_tokens_per_step=0,
            credit_alpha=0.0, credit_decay=0.0, credit_boost=1.0, iter_smooth=on, smooth_threshold_decay=0.02))
    slots = torch.arange(5)
    params.prepare(np.arange(5))
    got = params.row_parameters(slots).threshold
    assert torch.allclose(got, torch.tensor([1.0, 0.94, 0.8, 0.5, 0.5]))
    params.prepare(np.array([4]))  # no smoothing request in the step: thresholds as set
    assert torch.allclose(params.row_parameters(torch.tensor([4])).threshold, torch.tensor([0.5]))
