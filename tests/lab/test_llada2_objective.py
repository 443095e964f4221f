"""The LLaDA2 block-diffusion objective: the two-copy layout that trains every block as
decoding sees it, which canvas positions a row masks, edits and scores (mask ranges,
working first, given working), and the altered working rows it may be fed."""

from __future__ import annotations

import math
import random

import pytest
import torch

from tests.llada2_tiny import VOCAB, canvas_rows, prefix_lengths, tiny_model
from lab.training import llada2, llada2_objective


def test_two_copy_layout_attends_as_block_causal_decoding():
    # With nothing masked, each noisy block sees what decoding's block-causal window
    # sees (clean earlier blocks, itself): its logits are the plain forward's, and the
    # clean copy's are too.  Rows of different lengths pad without leaking.
    model, block = tiny_model(), 8
    prompts, canvases = canvas_rows(random.Random(0), 4, block)
    ids, positions, mask, valid, cols = llada2_objective.two_copy_layout(prompts, canvases, block, pad=7)
    hidden = model.hidden_states(ids, positions, mask, valid)
    for i, (p, c) in enumerate(zip(prompts, canvases)):
        seq = torch.tensor(p + c)
        pos = torch.arange(len(seq))[None]
        window = llada2.block_causal_mask(pos // block, torch.ones_like(pos, dtype=torch.bool))
        plain = model.hidden_states(seq[None], pos, window)[0]
        assert torch.allclose(hidden[i, cols[i, : len(c)]], plain[len(p):], atol=1e-5)
        # The clean copy holds every block but the last (which nothing reads).
        context = len(seq) - block
        assert ids[i, :context].tolist() == (p + c)[:context]
        assert torch.allclose(hidden[i, :context], plain[:context], atol=1e-5)
        # Noisy queries never see the clean copy of their own block or later ones.
        first = len(p) // block * block
        assert int(valid[i].sum()) == context + len(seq) - first
        seen = mask[i, context, :context].nonzero().flatten()  # the first noisy row
        assert int(seen.max()) < first if len(seen) else True


class _InputSpy(torch.nn.Module):
    """A model that records the ids the loss feeds it and predicts uniformly."""

    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(4, VOCAB, bias=False)
        torch.nn.init.zeros_(self.head.weight)

    def hidden_states(self, ids, positions, mask, valid):
        self.seen = ids.clone()
        return torch.ones(*ids.shape, 4)

    def logits(self, hidden):
        return self.head(hidden)


def test_loss_masks_and_corrupts_only_the_canvas():
    block, mask_id = 8, 2289
    prompts, canvases = canvas_rows(random.Random(1), 32, block)
    spy = _InputSpy()
    loss, _ = llada2_objective.block_diffusion_loss(spy, prompts, canvases, block, mask_id,
                                                    torch.Generator().manual_seed(0), pad_id=7)
    # Uniform predictions: every row costs ln V, whatever its number of masks (1/t weights).
    assert loss.item() == pytest.approx(math.log(VOCAB), rel=1e-5)
    spy2 = _InputSpy()
    loss2, stats = llada2_objective.block_diffusion_loss(spy2, prompts, canvases, block, mask_id,
                                                         torch.Generator().manual_seed(0), pad_id=7, edit_ratio=0.3)
    replaced = masked = 0
    _, _, _, _, cols = llada2_objective.two_copy_layout(prompts, canvases, block, 7)
    for i, (p, c) in enumerate(zip(prompts, canvases)):
        row = spy2.seen[i]
        context = len(p) + len(c) - block
        assert row[:context].tolist() == (p + c)[:context], "the clean copy is clean"
        canvas = row[cols[i, : len(c)]]
        masked += int((canvas == mask_id).sum())
        replaced += int(((canvas != mask_id) & (canvas != torch.tensor(c))).sum())
        assert 1 <= int((canvas == mask_id).sum()) <= len(c)
        first = len(p) // block * block
        assert row[context: context + len(p) - first].tolist() == p[first:], "prompt stays clean"
    assert replaced > 0 and masked > 0
    # Masked tokens at 1/k, plus every unmasked canvas position at 1/G: more than ln V.
    assert loss2.item() > loss.item() and stats["edit_fixed"] is not None


def test_mask_counts_keep_every_ratio_inside_the_range():
    lengths = torch.tensor([1, 2, 7, 20, 31, 64] * 50)
    strata = torch.rand(len(lengths), generator=torch.Generator().manual_seed(3))
    strata[:6] = 0.0  # the ends of the stratified draw are reached
    strata[6:12] = 1.0 - 1e-7
    whole = llada2_objective.mask_counts(lengths, strata)
    assert torch.equal(whole, torch.minimum((strata * lengths).long(), lengths - 1) + 1), "U{1..G} by default"
    lo, hi = 0.5, 0.8
    k = llada2_objective.mask_counts(lengths, strata, (lo, hi))
    assert bool((k >= 1).all() and (k <= lengths).all())
    ratio = k / lengths
    assert bool((ratio > lo).all()), "no row masks half its canvas or fewer"
    assert bool((ratio <= hi + 1 / lengths).all()), "at most one count above the range's top"
    # A row of 64 positions spans the range: its counts run from 33 to 52 of 64.
    wide = k[lengths == 64]
    assert int(wide.min()) == 33 and int(wide.max()) == 52


def test_a_narrow_mask_range_masks_more_of_every_canvas():
    block, mask_id = 8, 2289
    prompts, canvases = canvas_rows(random.Random(2), 32, block)
    _, _, _, _, cols = llada2_objective.two_copy_layout(prompts, canvases, block, 7)
    spy = _InputSpy()
    llada2_objective.block_diffusion_loss(spy, prompts, canvases, block, mask_id, torch.Generator().manual_seed(0),
                                          pad_id=7, mask_range=(0.75, 1.0))
    for i, c in enumerate(canvases):
        masked = int((spy.seen[i][cols[i, : len(c)]] == mask_id).sum())
        assert 0.75 * len(c) < masked <= len(c)


def _rows_with_prefixes(seed: int, block: int):
    """64 rows, their canvases' columns in the two-copy layout, and a leading span per
    row (working, or given working); the generator, to draw on from."""
    rng = random.Random(seed)
    prompts, canvases = canvas_rows(rng, 64, block)
    cols = llada2_objective.two_copy_layout(prompts, canvases, block, 7)[4]
    return rng, prompts, canvases, cols, prefix_lengths(rng, canvases)


def test_working_first_masks_the_result_before_any_working():
    """Ordered rows never show a masked working token beside a visible result token,
    nor an edited token; rows without working (w = 0) mask at random and are edited."""
    block, mask_id = 8, 2289
    rng, prompts, canvases, cols, working = _rows_with_prefixes(4, block)
    spy = _InputSpy()
    llada2_objective.block_diffusion_loss(spy, prompts, canvases, block, mask_id, torch.Generator().manual_seed(0),
                                          pad_id=7, working=working, edit_ratio=0.3)
    unordered_mixed = ordered_rows = unordered_edits = 0
    for i, c in enumerate(canvases):
        seen = spy.seen[i][cols[i, : len(c)]]
        masked = seen == mask_id
        edited = int(((seen != torch.tensor(c)) & ~masked).sum())
        if working[i] > 0:
            assert edited == 0, f"row {i}: an ordered row's visible tokens are its own"
        unordered_edits += edited if working[i] == 0 else 0
        w = int(working[i]) or rng.randint(1, max(1, len(c) - 1))
        working_masked, result_visible = bool(masked[:w].any()), bool((~masked[w:]).any())
        if working[i] > 0:
            ordered_rows += 1
            assert not (working_masked and result_visible), f"row {i}: working masked beside a visible result"
        else:
            unordered_mixed += working_masked and result_visible
    assert ordered_rows >= 20 and unordered_mixed > 0 and unordered_edits > 0
    with pytest.raises(ValueError, match="working lengths of shape"):
        llada2_objective.block_diffusion_loss(spy, prompts, canvases, block, mask_id, torch.Generator(), pad_id=7,
                                              working=working[:3])


class _ScoreSpy(_InputSpy):
    """An input spy that also records which (row, column) positions the loss scores."""

    def hidden_states(self, ids, positions, mask, valid):
        self.seen = ids.clone()
        b, w = ids.shape
        where = torch.stack(torch.meshgrid(torch.arange(b), torch.arange(w), indexing="ij"), -1).float()
        return torch.cat([where, torch.zeros(b, w, 2)], -1)

    def logits(self, hidden):
        self.scored = {(int(r), int(c)) for r, c in hidden[:, :2].tolist()}
        return super().logits(hidden)


def test_given_working_is_shown_as_written_and_never_masked_edited_or_scored():
    block, mask_id = 8, 2289
    rng, prompts, canvases, cols, given = _rows_with_prefixes(5, block)
    spy = _ScoreSpy()
    loss, _ = llada2_objective.block_diffusion_loss(spy, prompts, canvases, block, mask_id,
                                                    torch.Generator().manual_seed(0), pad_id=7, given=given,
                                                    edit_ratio=0.3)
    edited_given_rows = 0
    expected = 0.0
    for i, c in enumerate(canvases):
        seen = spy.seen[i][cols[i, : len(c)]]
        g = int(given[i])
        assert seen[:g].tolist() == c[:g], f"row {i}: the given working is shown as written"
        assert (seen[g:] == mask_id).any(), f"row {i}: something after the given working is masked"
        scored = {int(col) for r, col in spy.scored if r == i}
        assert scored == {int(col) for col in cols[i, g: len(c)]}, f"row {i}: every position after the working is scored, none in it"
        edited_given_rows += g > 0 and bool(((seen[g:] != torch.tensor(c[g:])) & (seen[g:] != mask_id)).any())
        # Uniform predictions: the k masked tokens cost ln V together (1/k each), the visible
        # ones ln V / (positions after the working) each; given positions count in neither.
        k, free = int((seen == mask_id).sum()), len(c) - g
        expected += (1 + (free - k) / free) * math.log(VOCAB) / len(canvases)
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert edited_given_rows > 0, "the positions after a given working are still edited"
    with pytest.raises(ValueError, match="given working lengths"):
        llada2_objective.block_diffusion_loss(spy, prompts, canvases, block, mask_id, torch.Generator(), pad_id=7,
                                              given=torch.tensor([len(c) for c in canvases]))


def test_altered_working_sums_the_partial_products_as_written():
    from lab.tasks import TRAIN, Instance, Multiply, multiply_answer
    from lab.training.altered_working import altered_working

    rng, task = random.Random(6), Multiply()
    altered_units = altered_tens = 0
    drawn = 0
    while drawn < 300:
        inst = task.sample(rng, TRAIN)
        if "=" not in inst.answer:
            continue
        drawn += 1
        out = altered_working(inst, rng)
        a, b = (int(x) for x in inst.prompt.removeprefix("mul ").removesuffix("=").split("*"))
        units, tens, total = out.answer.replace("+", "=").split("=")
        assert out.prompt == inst.prompt and out.task == "multiply"
        assert int(units) + int(tens) == int(total), out.answer
        assert str(int(units)) == units and str(int(tens)) == tens and tens.endswith("0"), out.answer
        assert out.answer != multiply_answer(a, b), "the working is changed"
        altered_units += int(units) != a * (b % 10)
        altered_tens += int(tens) != a * (b // 10) * 10
    assert altered_units > 100 and altered_tens > 100, "either partial product, and both, are altered"
    for answer in ("336", "12"):
        with pytest.raises(ValueError, match="only a multiply answer with working"):
            altered_working(Instance("multiply", "mul 48*7=", answer), rng)


def test_altered_working_keeps_a_padded_workings_width():
    from lab.tasks import TRAIN, Multiply
    from lab.training.altered_working import altered_working

    rng, task = random.Random(7), Multiply(width=6)
    drawn = wider = 0
    while drawn < 200:
        inst = task.sample(rng, TRAIN)
        if "=" not in inst.answer:
            continue
        drawn += 1
        units, tens, total = altered_working(inst, rng).answer.replace("+", "=").split("=")
        assert len(units) == len(tens) == 6 and len(total) >= 6 and int(units) + int(tens) == int(total)
        assert tens.endswith("0") and (len(total) == 6 or not total.startswith("0"))
        wider += len(total) > 6
    assert wider < drawn // 2, "only a sum past 999999 is wider"
