"""Unit tests for the pure decoding rules in vllm_dllm/decoding/.

Designed logits over a tiny vocabulary, no model and no engine.  The mask id lies
outside the vocabulary so a candidate token can never be mistaken for a mask.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from vllm_dllm.decoding import rng
from vllm_dllm.decoding.base import SpecialIds, make_rule
from vllm_dllm.decoding.dream import DreamRule, filter_top_k, filter_top_p
from vllm_dllm.decoding.llada import LLaDARule, transfer_counts
from vllm_dllm.decoding.logits import chunked_reduce, rows_per_chunk
from vllm_dllm.options import DREAM, LLADA, DreamOptions, LLaDAOptions

V = 16
MASK = 1000
EOS = 3
EOT = 5
IDS = SpecialIds(mask=MASK, eos=EOS, eot=EOT)
NEG_INF = float("-inf")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: intra-op threads only add contention on a loaded 2-core CPU."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def llada_opts(gen=8, steps=None, block=None, *, T=0.0, remasking="low_confidence",
               cfg=0.0, logits_eos_inf=False, conf_inf=False) -> LLaDAOptions:
    return LLaDAOptions(
        gen_length=gen,
        steps=gen if steps is None else steps,
        block_length=gen if block is None else block,
        remasking=remasking,
        temperature=T,
        cfg_scale=cfg,
        logits_eos_inf=logits_eos_inf,
        confidence_eos_eot_inf=conf_inf,
    )


def dream_opts(gen=16, steps=None, *, alg="maskgit_plus", alg_temp=None, T=0.0,
               top_p=None, top_k=None, eps=1e-3) -> DreamOptions:
    return DreamOptions(
        gen_length=gen,
        steps=gen if steps is None else steps,
        eps=eps,
        alg=alg,
        alg_temp=alg_temp,
        temperature=T,
        top_p=top_p,
        top_k=top_k,
    )


def llada(opts, seed=0, ids=IDS) -> LLaDARule:
    rule = make_rule(LLADA, opts, ids, seed)
    assert isinstance(rule, LLaDARule)
    return rule


def dream(opts, seed=0, ids=IDS) -> DreamRule:
    rule = make_rule(DREAM, opts, ids, seed)
    assert isinstance(rule, DreamRule)
    return rule


def logits_table(gen, seed=0, scale=3.0) -> torch.Tensor:
    """A fixed 'model': logits per canvas position, independent of the canvas."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(gen, V, generator=g, dtype=torch.float32) * scale


def run_step(rule, table):
    """One denoising step against a fixed logits table; returns (rows, tokens, conf)."""
    rows = rule.rows_needing_logits()
    tokens, conf = rule.reduce(table[rows].clone(), rows)
    rule.commit(rows, tokens, conf)
    return rows, tokens, conf


def test_make_rule_unknown_kind():
    with pytest.raises(ValueError, match="nope"):
        make_rule("nope", llada_opts(), IDS, 0)


def test_initial_canvas_all_masked():
    for rule in (llada(llada_opts(gen=6)), dream(dream_opts(gen=6))):
        assert rule.canvas.tolist() == [MASK] * 6
        assert rule.masked.all() and not rule.done
        assert rule.num_final() == 0 and rule.step == 0


# ---------------------------------------------------------------------------
# LLaDA: transfer counts, rows, commit, blocks
# ---------------------------------------------------------------------------


def test_transfer_counts_matches_spec():
    for m in range(0, 70):
        for s in range(1, 20):
            counts = transfer_counts(m, s)
            assert len(counts) == s
            assert sum(counts) == m
            expected = [m // s + (1 if i < m % s else 0) for i in range(s)]
            assert counts == expected
            assert counts == sorted(counts, reverse=True)


def test_transfer_counts_hand_values():
    assert transfer_counts(32, 32) == [1] * 32
    assert transfer_counts(10, 4) == [3, 3, 2, 2]
    assert transfer_counts(3, 5) == [1, 1, 1, 0, 0]
    assert transfer_counts(0, 3) == [0, 0, 0]


def test_llada_rows_only_masked_positions_of_current_block():
    rule = llada(llada_opts(gen=8, steps=4, block=4))  # 2 blocks, 2 steps per block
    rows = rule.rows_needing_logits()
    assert rows.tolist() == [0, 1, 2, 3]
    # Commit positions 1 and 3 (the two most confident).
    conf = torch.tensor([0.1, 0.9, 0.2, 0.8])
    rule.commit(rows, torch.tensor([10, 11, 12, 13]), conf)
    assert rule.canvas.tolist() == [MASK, 11, MASK, 13] + [MASK] * 4
    rows = rule.rows_needing_logits()
    assert rows.tolist() == [0, 2]
    rule.commit(rows, torch.tensor([7, 8]), torch.tensor([0.5, 0.4]))
    assert rule.canvas[:4].tolist() == [7, 11, 8, 13]
    # Block 0 is full after steps_per_block steps: block 1 now.
    assert rule.block == 1 and rule.step_in_block == 0
    assert rule.rows_needing_logits().tolist() == [4, 5, 6, 7]


def test_llada_commit_writes_scheduled_count_most_confident():
    gen, steps = 10, 4  # one block: counts [3, 3, 2, 2]
    rule = llada(llada_opts(gen=gen, steps=steps))
    g = torch.Generator().manual_seed(3)
    expected_counts = transfer_counts(gen, steps)
    for step in range(steps):
        rows = rule.rows_needing_logits()
        conf = torch.rand(len(rows), generator=g)
        tokens = torch.arange(len(rows)) + 100 * (step + 1)
        before = rule.canvas.clone()
        rule.commit(rows, tokens, conf)
        changed = (rule.canvas != before).nonzero().flatten()
        assert len(changed) == expected_counts[step]
        top = torch.topk(conf, expected_counts[step]).indices
        assert sorted(changed.tolist()) == sorted(rows[top].tolist())
        assert rule.canvas[rows[top]].tolist() == tokens[top].tolist()
    assert rule.done


def test_llada_num_final_is_committed_prefix():
    rule = llada(llada_opts(gen=6, steps=3))  # counts [2, 2, 2]
    rows = rule.rows_needing_logits()
    rule.commit(rows, torch.arange(6) + 20, torch.tensor([0, 0.9, 0.8, 0, 0, 0]))
    assert rule.canvas.tolist()[:3] == [MASK, 21, 22]
    assert rule.num_final() == 0
    rows = rule.rows_needing_logits()  # [0, 3, 4, 5]
    rule.commit(rows, torch.tensor([30, 33, 34, 35]), torch.tensor([0.9, 0.1, 0.2, 0.8]))
    assert rule.canvas.tolist() == [30, 21, 22, MASK, MASK, 35]
    assert rule.num_final() == 3
    rows = rule.rows_needing_logits()
    rule.commit(rows, torch.tensor([43, 44]), torch.tensor([0.5, 0.5]))
    assert rule.num_final() == 6 and rule.done


def reference_llada_step(x, table, opts: LLaDAOptions, ids: SpecialIds, block: int, count: int):
    """One step of MODEL_SPEC.md section 3 LLaDA (T=0, low_confidence) on canvas x.

    Returns the candidates x0, the confidence vector (-inf off the masked rows of the
    block) and the reference's choice torch.topk(conf, count).
    """
    hi = (block + 1) * opts.block_length
    logits = table.clone()
    if opts.logits_eos_inf:
        logits[:, ids.eos] = NEG_INF
    x0 = logits.argmax(-1)
    if opts.confidence_eos_eot_inf:
        logits[:, ids.eos] = NEG_INF
        logits[:, ids.eot] = NEG_INF
    p = torch.softmax(logits, -1)
    x0_p = p.gather(1, x0[:, None]).squeeze(1)
    x0_p[hi:] = NEG_INF
    mask = x == ids.mask
    x0 = torch.where(mask, x0, x)
    conf = torch.where(mask, x0_p, torch.tensor(NEG_INF))
    return x0, conf, torch.topk(conf, count).indices


@pytest.mark.parametrize(
    "gen, steps, block, flags",
    [
        (8, 8, 8, {}),
        (8, 4, 4, {}),
        (12, 6, 4, {}),
        (16, 32, 8, {}),  # more steps than tokens: zero counts
        (16, 8, 4, {"logits_eos_inf": True}),
        (16, 16, 8, {"conf_inf": True}),
        (24, 12, 8, {"conf_inf": True, "logits_eos_inf": True}),
    ],
)
def test_llada_matches_reference_steps_on_fixed_logits(gen, steps, block, flags):
    """Each step commits the reference's count, tokens and top-k set.

    Where the reference's top-k cut falls on a tie (systematic with
    confidence_eos_eot_inf: every EOS/EoT-argmax row has confidence exactly 0) torch's
    tie-breaking depends on the vector's length, so only a valid top-k is required.
    """
    opts = llada_opts(gen=gen, steps=steps, block=block, **flags)
    ties = 0
    for seed in range(4):
        table = logits_table(gen, seed=seed)
        # Make EOS/EoT frequent argmaxes so the flags matter.
        table[::3, EOS] += 6.0
        table[1::4, EOT] += 6.0
        rule = llada(opts)
        counts: list[int] = []
        for step in range(steps):
            block_idx, i = divmod(step, opts.steps_per_block)
            lo, hi = block_idx * block, (block_idx + 1) * block
            if i == 0:
                m = int((rule.canvas[lo:hi] == MASK).sum())
                counts = [m // opts.steps_per_block + (j < m % opts.steps_per_block)
                          for j in range(opts.steps_per_block)]
            x = rule.canvas.clone()
            x0, conf, ref_choice = reference_llada_step(x, table, opts, IDS, block_idx, counts[i])

            rows = rule.rows_needing_logits()
            assert rule.block_bounds() == (lo, hi)
            # Only the masked rows of the current block need logits.
            assert rows.tolist() == [r for r in range(lo, hi) if x[r] == MASK]
            if len(rows):
                tokens, c = rule.reduce(table[rows].clone(), rows)
                assert tokens.tolist() == x0[rows].tolist()
                assert torch.allclose(c, conf[rows], rtol=1e-6, atol=0)
            else:
                tokens, c = torch.empty(0, dtype=torch.long), torch.empty(0)
            rule.commit(rows, tokens, c)

            newly = ((x == MASK) & (rule.canvas != MASK)).nonzero().flatten()
            assert len(newly) == counts[i], (seed, step)
            assert rule.canvas[newly].tolist() == x0[newly].tolist()
            assert (rule.canvas[hi:] == MASK).all()  # nothing beyond the block
            k = counts[i]
            if k:
                vals = conf.sort(descending=True).values
                tied = k < len(vals) and vals[k - 1] == vals[k]
                ties += bool(tied)
                if tied:
                    rest = (x == MASK) & (rule.canvas == MASK)
                    assert conf[newly].min() >= conf[rest].max()
                else:
                    assert sorted(newly.tolist()) == sorted(ref_choice.tolist()), (seed, step)
        assert rule.done
    if flags.get("conf_inf"):
        assert ties > 0  # the designed table does exercise the zero-confidence ties


def test_llada_block_advances_after_steps_per_block():
    opts = llada_opts(gen=12, steps=6, block=4)  # 3 blocks, 2 steps each
    rule = llada(opts)
    table = logits_table(12)
    for step in range(6):
        assert rule.block == step // 2
        run_step(rule, table)
        if step % 2 == 1:
            blk = step // 2
            assert (rule.canvas[: (blk + 1) * 4] != MASK).all()
            assert (rule.canvas[(blk + 1) * 4:] == MASK).all()
    assert rule.done


# ---------------------------------------------------------------------------
# LLaDA: EOS / EoT handling with designed logits (DESIGN.md section 4)
# ---------------------------------------------------------------------------


def designed_rows() -> torch.Tensor:
    rows = torch.zeros(4, V)
    rows[0, EOS], rows[0, 7] = 5.0, 2.0  # argmax EOS
    rows[1, EOT], rows[1, 8] = 5.0, 2.0  # argmax EoT
    rows[2, 9], rows[2, EOS], rows[2, EOT] = 5.0, 3.0, 2.5  # argmax 9, EOS/EoT mass
    rows[3, 10] = 4.0  # plain
    return rows


def softmax_without(row: torch.Tensor, drop: list[int], token: int) -> float:
    row = row.clone()
    row[drop] = NEG_INF
    return float(torch.softmax(row, -1)[token])


POS = torch.tensor([0, 1, 2, 3])


def test_confidence_eos_eot_inf_at_t0():
    rows = designed_rows()
    rule = llada(llada_opts(gen=4, steps=2, conf_inf=True))  # commits 2 per step
    rule.rows_needing_logits()
    tokens, conf = rule.reduce(rows.clone(), POS)
    # The argmax is taken before the columns are removed.
    assert tokens.tolist() == [EOS, EOT, 9, 10]
    # Rows whose argmax is EOS or EoT get confidence 0 (their column is -inf).
    assert conf[0].item() == 0.0 and conf[1].item() == 0.0
    # Other rows are renormalised without the EOS/EoT mass.
    for r, tok in ((2, 9), (3, 10)):
        assert conf[r].item() == pytest.approx(softmax_without(rows[r], [EOS, EOT], tok), rel=1e-6)
    assert conf[2].item() > float(torch.softmax(rows[2], -1)[9]) + 0.1
    # So the committed token is never EOS/EoT when anything else is available.
    rule.commit(POS, tokens, conf)
    assert rule.canvas.tolist() == [MASK, MASK, 9, 10]


def test_without_flag_eos_keeps_its_confidence():
    rows = designed_rows()
    rule = llada(llada_opts(gen=4))
    rule.rows_needing_logits()
    tokens, conf = rule.reduce(rows.clone(), POS)
    assert tokens.tolist() == [EOS, EOT, 9, 10]
    for r, tok in enumerate(tokens.tolist()):
        assert conf[r].item() == pytest.approx(float(torch.softmax(rows[r], -1)[tok]), rel=1e-6)


def test_confidence_eos_eot_inf_at_positive_t_removes_only_eot():
    # T small enough that the Gumbel factor (in [~0.6, ~1.07]) cannot flip a 3-nat gap.
    rows = designed_rows()
    for seed in range(5):
        rule = llada(llada_opts(gen=4, T=0.01, conf_inf=True), seed=seed)
        rule.rows_needing_logits()
        tokens, conf = rule.reduce(rows.clone(), POS)
        assert tokens.tolist() == [EOS, EOT, 9, 10]
        # EOS keeps its mass; EoT's column is gone.
        assert conf[0].item() == pytest.approx(softmax_without(rows[0], [EOT], EOS), rel=1e-6)
        assert conf[0].item() > 0.8
        assert conf[1].item() == 0.0
        assert conf[2].item() == pytest.approx(softmax_without(rows[2], [EOT], 9), rel=1e-6)
        assert conf[3].item() == pytest.approx(softmax_without(rows[3], [EOT], 10), rel=1e-6)


def test_confidence_eos_eot_inf_without_eot_id():
    rows = designed_rows()
    ids = SpecialIds(mask=MASK, eos=EOS, eot=None)
    rule = llada(llada_opts(gen=4, conf_inf=True), ids=ids)
    rule.rows_needing_logits()
    _, conf = rule.reduce(rows.clone(), POS)
    assert conf[0].item() == 0.0
    assert conf[2].item() == pytest.approx(softmax_without(rows[2], [EOS], 9), rel=1e-6)


@pytest.mark.parametrize("T", [0.0, 0.01, 1.0])
def test_logits_eos_inf_never_chooses_eos(T):
    rows = designed_rows()
    rows[:, EOS] = 30.0  # EOS dominates every row
    for seed in range(4):
        rule = llada(llada_opts(gen=4, T=T, logits_eos_inf=True), seed=seed)
        rule.rows_needing_logits()
        tokens, conf = rule.reduce(rows.clone(), POS)
        assert EOS not in tokens.tolist()
        assert torch.isfinite(conf).all() and (conf > 0).all()
        if T == 0:
            assert tokens.tolist() == [7, EOT, 9, 10]
            assert conf[0].item() == pytest.approx(softmax_without(rows[0], [EOS], 7), rel=1e-6)


def test_llada_gumbel_matches_spec_and_is_chunk_invariant():
    gen, T, seed = 6, 0.7, 11
    table = logits_table(gen, seed=5, scale=1.0)
    rule = llada(llada_opts(gen=gen, T=T), seed=seed)
    rows = rule.rows_needing_logits()
    tokens, conf = rule.reduce(table.clone(), rows)
    # Independent transcription of add_gumbel_noise with the rng contract.
    for pos in range(gen):
        g = rng.generator(seed, 0, pos, rng.GUMBEL)
        u = torch.rand(V, dtype=torch.float64, generator=g)
        noisy = torch.exp(table[pos].double()) / (-torch.log(u)) ** T
        assert int(tokens[pos]) == int(noisy.argmax())
        assert conf[pos].item() == pytest.approx(
            float(torch.softmax(table[pos], -1)[tokens[pos]]), rel=1e-6)
    # Row-by-row reduction gives the same draws (keys depend on position, not row).
    for pos in [4, 0, 2]:
        t1, c1 = rule.reduce(table[pos:pos + 1].clone(), torch.tensor([pos]))
        assert int(t1) == int(tokens[pos]) and float(c1) == float(conf[pos])
    # A different seed or step gives different noise somewhere.
    other = llada(llada_opts(gen=gen, T=T), seed=seed + 1)
    other.rows_needing_logits()
    hot = table * 0.05  # flat logits: the noise decides
    t_a, _ = rule.reduce(hot.clone(), rows)
    t_b, _ = other.reduce(hot.clone(), rows)
    assert t_a.tolist() != t_b.tolist()


def test_llada_random_remasking_confidence():
    gen, seed = 5, 9
    rule = llada(llada_opts(gen=gen, remasking="random"), seed=seed)
    rows = rule.rows_needing_logits()
    table = logits_table(gen)
    tokens, conf = rule.reduce(table.clone(), rows)
    assert tokens.tolist() == table.argmax(-1).tolist()
    for pos in range(gen):
        u = torch.rand(1, dtype=torch.float32, generator=rng.generator(seed, 0, pos, rng.REMASK))
        assert float(conf[pos]) == float(u[0])
    assert ((conf >= 0) & (conf < 1)).all()


# ---------------------------------------------------------------------------
# Dream
# ---------------------------------------------------------------------------


def spec_dream_count(num_masked: int, step: int, opts: DreamOptions) -> int:
    ts = torch.linspace(1, opts.eps, opts.steps + 1)
    if step == opts.steps - 1:
        return num_masked
    n = torch.tensor([num_masked]).sum() / 1  # int64 tensor / int -> float32, as the reference
    return int(n * (1 - ts[step + 1] / ts[step]))


@pytest.mark.parametrize(
    "gen, alg",
    [(16, "maskgit_plus"), (256, "maskgit_plus"), (512, "maskgit_plus"),
     (16, "topk_margin"), (16, "entropy"), (64, "entropy")],
)
def test_dream_steps_equal_gen_truncation(gen, alg):
    opts = dream_opts(gen=gen, alg=alg)
    rule = dream(opts)
    table = logits_table(gen, seed=gen)
    committed = []
    for step in range(opts.steps):
        before = int(rule.masked.sum())
        rows = rule.rows_needing_logits()
        assert len(rows) == before  # a confidence alg needs every masked row
        if gen <= 64:
            tokens, conf = rule.reduce(table[rows].clone(), rows)
        else:  # the count does not depend on the confidences: skip the softmaxes
            tokens, conf = table[rows].argmax(-1), table[rows].max(-1).values
        rule.commit(rows, tokens, conf)
        n = before - int(rule.masked.sum())
        assert n == spec_dream_count(before, step, opts), step
        committed.append(n)
    assert committed[0] == 0  # int() truncation: (1 - eps) < 1
    assert committed[-1] == 2  # MODEL_SPEC.md: 2 on the last step for these lengths
    assert sum(committed) == gen
    assert rule.done and rule.num_final() == gen


def test_dream_confidence_alg_commits_most_confident():
    gen = 8
    for alg in ("maskgit_plus", "topk_margin", "entropy"):
        opts = dream_opts(gen=gen, steps=2, alg=alg)  # step 0 commits int(8*(1-s/t)) = 3
        rule = dream(opts)
        table = logits_table(gen, seed=1)
        rows = rule.rows_needing_logits()
        tokens, conf = rule.reduce(table.clone(), rows)
        probs = torch.softmax(table, -1)
        assert tokens.tolist() == table.argmax(-1).tolist()
        if alg == "maskgit_plus":
            expected = probs.max(-1).values
        elif alg == "topk_margin":
            top2 = probs.topk(2, -1).values
            expected = top2[:, 0] - top2[:, 1]
        else:
            expected = (probs * torch.log(probs + 1e-10)).sum(-1)
        assert torch.allclose(conf, expected, rtol=1e-6, atol=1e-7)
        rule.commit(rows, tokens, conf)
        n = spec_dream_count(gen, 0, opts)
        assert n == 3
        top = torch.topk(expected, n).indices
        assert sorted((rule.canvas != MASK).nonzero().flatten().tolist()) == sorted(top.tolist())
        run_step(rule, table)
        assert rule.done and rule.canvas.tolist() == table.argmax(-1).tolist()


@pytest.mark.parametrize("gen, steps", [(16, 16), (16, 4), (7, 3), (32, 1)])
def test_dream_origin_t0_fills_all_by_last_step(gen, steps):
    for seed in range(3):
        rule = dream(dream_opts(gen=gen, steps=steps, alg="origin"), seed=seed)
        table = logits_table(gen, seed=seed)
        for step in range(steps):
            masked = rule.masked.nonzero().flatten()
            rows = rule.rows_needing_logits()
            assert set(rows.tolist()) <= set(masked.tolist())
            if step == steps - 1:
                assert rows.tolist() == masked.tolist()
            before = rule.canvas.clone()
            run_step(rule, table)
            changed = (rule.canvas != before).nonzero().flatten()
            # origin writes exactly the flipped rows, with their argmax at T=0.
            assert changed.tolist() == rows.tolist()
            assert rule.canvas[rows].tolist() == table[rows].argmax(-1).tolist()
        assert rule.done
        assert rule.canvas.tolist() == table.argmax(-1).tolist()


def test_dream_origin_flips_follow_rng_contract():
    gen, steps, seed = 40, 4, 21
    rule = dream(dream_opts(gen=gen, steps=steps, alg="origin"), seed=seed)
    ts = torch.linspace(1, 1e-3, steps + 1)
    p = 1 - ts[1] / ts[0]
    expected = [
        pos for pos in range(gen)
        if torch.rand(1, generator=rng.generator(seed, 0, pos, rng.FLIP))[0] < p
    ]
    assert rule.rows_needing_logits().tolist() == expected
    assert 0 < len(expected) < gen  # p = 0.25: a vacuous draw would be suspicious


def test_filter_top_p_known_logits():
    logits = torch.tensor([[1.0, 3.0, 0.0, 2.0]])  # probs sorted ~ .644 .237 .087 .032
    lo = torch.finfo(torch.float32).min
    out = filter_top_p(logits, 0.5)
    assert out.tolist() == [[lo, 3.0, lo, lo]]  # keeps at least the top token
    out = filter_top_p(logits, 1e-9)
    assert out.tolist() == [[lo, 3.0, lo, lo]]
    out = filter_top_p(logits, 0.7)
    assert out.tolist() == [[lo, 3.0, lo, 2.0]]
    out = filter_top_p(logits, 0.9)
    assert out.tolist() == [[1.0, 3.0, lo, 2.0]]
    out = filter_top_p(logits, 0.999)
    assert out.tolist() == logits.tolist()
    # Rows are independent.
    two = torch.tensor([[1.0, 3.0, 0.0, 2.0], [10.0, 0.0, 0.0, 0.0]])
    assert filter_top_p(two, 0.7).tolist() == [[lo, 3.0, lo, 2.0], [10.0, lo, lo, lo]]


def test_filter_top_k_known_logits():
    logits = torch.tensor([[1.0, 3.0, 0.0, 2.0], [5.0, 4.0, 3.0, 6.0]])
    lo = torch.finfo(torch.float32).min
    assert filter_top_k(logits, 1).tolist() == [[lo, 3.0, lo, lo], [lo, lo, lo, 6.0]]
    assert filter_top_k(logits, 2).tolist() == [[lo, 3.0, lo, 2.0], [5.0, lo, lo, 6.0]]
    assert filter_top_k(logits, 4).tolist() == logits.tolist()
    assert filter_top_k(logits, 100).tolist() == logits.tolist()  # k clipped to vocab
    # Ties at the k-th value are all kept (the reference removes only `< kth`).
    tied = torch.tensor([[2.0, 1.0, 2.0, 2.0]])
    assert filter_top_k(tied, 1).tolist() == [[2.0, lo, 2.0, 2.0]]
    # k kept on random rows.
    x = torch.randn(20, 50, generator=torch.Generator().manual_seed(0))
    for k in (1, 3, 17):
        assert ((filter_top_k(x, k) > lo).sum(-1) == k).all()


def test_dream_top_k_renormalises_confidence_at_t0():
    row = torch.tensor([[4.0, 3.0, 1.0] + [0.0] * (V - 3)])
    pos = torch.tensor([0])
    rule = dream(dream_opts(gen=1, top_k=2))
    tokens, conf = rule.reduce(row.clone(), pos)
    assert int(tokens) == 0
    assert conf.item() == pytest.approx(math.exp(4) / (math.exp(4) + math.exp(3)), rel=1e-6)
    rule = dream(dream_opts(gen=1, top_p=0.5))
    tokens, conf = rule.reduce(row.clone(), pos)
    assert int(tokens) == 0 and conf.item() == pytest.approx(1.0)
    rule = dream(dream_opts(gen=1))
    _, conf = rule.reduce(row.clone(), pos)
    assert conf.item() == pytest.approx(float(torch.softmax(row[0], -1)[0]), rel=1e-6)


def test_dream_sampling_t_positive_rng_and_chunk_invariance():
    gen, seed = 12, 4
    table = logits_table(gen, seed=2, scale=1.0)
    rule = dream(dream_opts(gen=gen, T=0.8, top_p=0.95), seed=seed)
    rows = rule.rows_needing_logits()
    tokens, conf = rule.reduce(table.clone(), rows)
    for pos in range(gen):
        probs = torch.softmax(filter_top_p(table[pos:pos + 1] / 0.8, 0.95), -1)[0]
        g = rng.generator(seed, 0, pos, rng.SAMPLE)
        assert int(tokens[pos]) == int(torch.multinomial(probs, 1, replacement=True, generator=g)[0])
        assert conf[pos].item() == pytest.approx(float(probs[tokens[pos]]), rel=1e-6)
    for pos in (7, 0):
        t1, c1 = rule.reduce(table[pos:pos + 1].clone(), torch.tensor([pos]))
        assert int(t1) == int(tokens[pos]) and float(c1) == float(conf[pos])
    # top_k=1 at T > 0: the sample is the argmax.
    rule = dream(dream_opts(gen=gen, T=1.5, top_k=1), seed=seed)
    t, c = rule.reduce(table.clone(), rows)
    assert t.tolist() == table.argmax(-1).tolist() and torch.allclose(c, torch.ones(gen))


def test_dream_alg_temp_selection():
    gen, steps = 20, 4
    table = logits_table(gen, seed=8)
    runs = []
    for _ in range(2):
        rule = dream(dream_opts(gen=gen, steps=steps, alg="entropy", alg_temp=0.5), seed=3)
        hist = []
        for step in range(steps):
            before = int(rule.masked.sum())
            masked_before = rule.masked.clone()
            run_step(rule, table)
            newly = masked_before & ~rule.masked
            assert int(newly.sum()) == spec_dream_count(before, step, rule.options)
            hist.append(rule.canvas.clone())
        assert rule.done
        runs.append(hist)
    assert all(torch.equal(a, b) for a, b in zip(*runs))  # deterministic given the seed
    other = dream(dream_opts(gen=gen, steps=steps, alg="entropy", alg_temp=0.5), seed=4)
    run_step(other, table)
    run_step(other, table)
    assert not torch.equal(other.canvas, runs[0][1])  # seed matters (overwhelmingly)


# ---------------------------------------------------------------------------
# logits.chunked_reduce
# ---------------------------------------------------------------------------


def make_project(W: torch.Tensor, max_rows: int, calls: list):
    def project(h: torch.Tensor) -> torch.Tensor:
        assert h.shape[0] <= max_rows, (h.shape, max_rows)
        calls.append(h.shape[0])
        return h @ W

    return project


def simple_reduce(seen: list):
    def reduce(logits, positions):
        seen.append((logits.clone(), positions.clone()))
        assert logits.shape[0] == positions.shape[0]
        return logits.argmax(-1), logits.max(-1).values + 1000.0 * positions.double()

    return reduce


def test_chunked_reduce_identical_across_chunk_sizes():
    g = torch.Generator().manual_seed(0)
    n_hidden, H, vocab = 57, 12, 33
    hidden = torch.randn(n_hidden, H, generator=g, dtype=torch.float64)
    W = torch.randn(H, vocab, generator=g, dtype=torch.float64)
    cond_rows = torch.randperm(n_hidden, generator=g)[:41]
    positions = torch.randint(0, 500, (41,), generator=g)
    ref_logits = hidden[cond_rows] @ W
    ref_tokens = ref_logits.argmax(-1)
    ref_conf = ref_logits.max(-1).values + 1000.0 * positions.double()
    results = []
    for max_rows in (1, 3, 1000):
        calls, seen = [], []
        tokens, conf = chunked_reduce(hidden, cond_rows, positions,
                                      make_project(W, max_rows, calls), simple_reduce(seen),
                                      max_rows)
        assert sum(calls) == len(cond_rows)
        assert calls == [min(max_rows, len(cond_rows) - i)
                         for i in range(0, len(cond_rows), max_rows)]
        assert torch.cat([p for _, p in seen]).tolist() == positions.tolist()
        assert tokens.tolist() == ref_tokens.tolist()
        assert torch.allclose(conf, ref_conf, rtol=0, atol=1e-9)
        results.append((tokens, conf))
    for tokens, conf in results[1:]:
        assert torch.equal(tokens, results[0][0])
        assert torch.allclose(conf, results[0][1], rtol=0, atol=1e-9)


def test_chunked_reduce_empty():
    hidden = torch.randn(4, 3)
    called = []
    tokens, conf = chunked_reduce(hidden, torch.empty(0, dtype=torch.long),
                                  torch.empty(0, dtype=torch.long),
                                  lambda h: called.append(1), lambda l, p: called.append(2), 8)
    assert called == []
    assert tokens.shape == (0,) and tokens.dtype == torch.long
    assert conf.shape == (0,) and conf.dtype == torch.float32


@pytest.mark.parametrize("max_rows", [2, 5, 6, 1000])
@pytest.mark.parametrize("cfg", [0.0, 0.5, 2.0])
def test_chunked_reduce_cfg(max_rows, cfg):
    g = torch.Generator().manual_seed(1)
    n, H, vocab = 30, 8, 21
    hidden = torch.randn(2 * n, H, generator=g, dtype=torch.float64)
    W = torch.randn(H, vocab, generator=g, dtype=torch.float64)
    cond_rows = torch.arange(n)
    uncond_rows = torch.arange(n, 2 * n)
    positions = torch.arange(n) * 3
    calls, seen = [], []
    tokens, conf = chunked_reduce(hidden, cond_rows, positions,
                                  make_project(W, max_rows, calls), simple_reduce(seen), max_rows,
                                  uncond_rows=uncond_rows, cfg_scale=cfg)
    per_chunk = max_rows // 2
    assert rows_per_chunk(max_rows, 2) == per_chunk
    assert [p.shape[0] for _, p in seen] == [min(per_chunk, n - i) for i in range(0, n, per_chunk)]
    assert calls == [2 * p.shape[0] for _, p in seen]
    cond, un = hidden[cond_rows] @ W, hidden[uncond_rows] @ W
    expected = un + (cfg + 1) * (cond - un)
    got = torch.cat([l for l, _ in seen])
    assert torch.allclose(got, expected, rtol=0, atol=1e-9)
    assert tokens.tolist() == expected.argmax(-1).tolist()
    assert torch.cat([p for _, p in seen]).tolist() == positions.tolist()


def test_rows_per_chunk():
    assert rows_per_chunk(1024, 1) == 1024
    assert rows_per_chunk(1024, 2) == 512
    assert rows_per_chunk(7, 2) == 3
    assert rows_per_chunk(1, 1) == 1


def test_chunked_reduce_cfg_max_rows_one_respects_bound():
    hidden = torch.randn(4, 3, dtype=torch.float64)
    W = torch.randn(3, 5, dtype=torch.float64)
    with pytest.raises(ValueError, match="cannot hold 2 rows"):
        chunked_reduce(hidden, torch.arange(2), torch.arange(2), make_project(W, 1, []),
                   simple_reduce([]), 1, uncond_rows=torch.arange(2, 4), cfg_scale=1.0)


def test_chunked_reduce_through_llada_rule_is_chunk_invariant():
    """The real rule as reducer: chunking never changes tokens or confidences."""
    g = torch.Generator().manual_seed(2)
    gen, H = 24, 6
    hidden = torch.randn(gen, H, generator=g)
    W = torch.randn(H, V, generator=g) * 3
    for T in (0.0, 0.9):
        out = []
        for max_rows in (1, 5, 64):
            rule = llada(llada_opts(gen=gen, T=T, conf_inf=True), seed=5)
            rows = rule.rows_needing_logits()
            out.append(chunked_reduce(hidden, rows, rows, make_project(W, max_rows, []),
                                      rule.reduce, max_rows))
        for tokens, conf in out[1:]:
            assert torch.equal(tokens, out[0][0])
            assert torch.allclose(conf, out[0][1], rtol=1e-6, atol=0)


# ---------------------------------------------------------------------------
# rng
# ---------------------------------------------------------------------------


def test_splitmix64_known_vector():
    # SplitMix64 seeded with 0: first output 0xE220A8397B1DCDAF (Vigna's reference).
    assert rng._splitmix64(0) == 0xE220A8397B1DCDAF


def reference_key(seed, step, position, stream):
    u64 = 2**64
    key = seed % u64
    for part in (None, step, position, stream):
        key ^= 0 if part is None else part % u64
        key = (key + 0x9E3779B97F4A7C15) % u64
        key = ((key ^ (key >> 30)) * 0xBF58476D1CE4E5B9) % u64
        key = ((key ^ (key >> 27)) * 0x94D049BB133111EB) % u64
        key ^= key >> 31
    return key >> 1


def test_stream_key_matches_contract_and_is_deterministic():
    r = random.Random(0)
    for _ in range(300):
        args = (r.randrange(-2**63, 2**64), r.randrange(0, 10_000), r.randrange(-1, 10_000),
                r.choice([rng.GUMBEL, rng.REMASK, rng.FLIP, rng.SAMPLE, rng.SELECT]))
        key = rng.stream_key(*args)
        assert key == rng.stream_key(*args) == reference_key(*args)
        assert 0 <= key < 2**63  # accepted by manual_seed
    assert rng.stream_key(-1, 0, 0, 1) == rng.stream_key(2**64 - 1, 0, 0, 1)  # seed mod 2**64


STREAMS = [rng.GUMBEL, rng.REMASK, rng.FLIP, rng.SAMPLE, rng.SELECT]


@pytest.mark.parametrize("seed", [0, 1, 42, 2**32, 2**63 + 5, -7])
def test_stream_keys_distinct_across_step_position_stream(seed):
    grid = list(itertools.product(range(64), range(-1, 96), STREAMS))
    keys = {rng.stream_key(seed, *a) for a in grid}
    assert len(keys) == len(grid)


def test_stream_keys_distinct_across_stream_ids_and_seeds_at_step_zero():
    grid = list(itertools.product(range(50), range(-1, 200), STREAMS))
    keys = {rng.stream_key(s, 0, p, st) for s, p, st in grid}
    assert len(keys) == len(grid)


def test_stream_keys_distinct_across_seeds_and_steps():
    # e.g. seed 0 at step 1 replays seed 1's step-0 noise, position for position.
    grid = list(itertools.product([0, 1], range(4), range(4), STREAMS))
    keys = {rng.stream_key(*a) for a in grid}
    assert len(keys) == len(grid)
    # Argument order matters: (step, position) is not symmetric.
    assert rng.stream_key(0, 1, 2, 1) != rng.stream_key(0, 2, 1, 1)
    assert rng.stream_key(0, 0, rng.WHOLE_CANVAS, rng.SELECT) != rng.stream_key(0, 0, 0, rng.SELECT)
    assert len(set(STREAMS)) == 5 and rng.WHOLE_CANVAS not in range(0, 1 << 20)


def test_generator_draws_deterministic_and_distinct():
    a = torch.rand(8, generator=rng.generator(7, 3, 5, rng.GUMBEL))
    b = torch.rand(8, generator=rng.generator(7, 3, 5, rng.GUMBEL))
    assert torch.equal(a, b)
    for other in [(8, 3, 5, rng.GUMBEL), (7, 4, 5, rng.GUMBEL), (7, 3, 6, rng.GUMBEL),
                  (7, 3, 5, rng.REMASK)]:
        assert not torch.equal(a, torch.rand(8, generator=rng.generator(*other)))
    assert rng.generator(7, 3, 5, rng.GUMBEL).device.type == "cpu"


@pytest.mark.parametrize("prompt_len", [0, 4, 10, 37])
def test_ties_break_as_the_reference_ranks_the_whole_sequence(prompt_len):
    """The references call topk on a prompt+canvas vector with -inf off the
    candidates; equal confidences (routine with confidence_eos_eot_inf) must be
    broken the same way."""
    gen = 6
    confidence = torch.tensor([0.0, 0.0, 0.0, 0.92, 0.0, 0.0])
    rule = make_rule(LLADA, llada_opts(gen=gen, steps=2, block=gen), IDS, seed=0, prompt_len=prompt_len)
    positions = rule.rows_needing_logits()
    tokens = torch.arange(gen) + 1
    rule.commit(positions, tokens, confidence)
    reference = torch.full((prompt_len + gen,), float("-inf"))
    reference[prompt_len:] = confidence
    expected = sorted((torch.topk(reference, 3).indices - prompt_len).tolist())
    committed = sorted((rule.canvas != MASK).nonzero().flatten().tolist())
    assert committed == expected


def test_a_canvas_is_final_after_its_steps_even_if_a_mask_was_committed():
    """The references return the canvas after `steps` steps whatever it holds; a
    position committed as the mask id itself must not keep the request alive."""
    rule = make_rule(LLADA, llada_opts(gen=4, steps=4, block=4), IDS, seed=0, prompt_len=3)
    for _ in range(4):
        positions = rule.rows_needing_logits()
        tokens = torch.full((len(positions),), MASK)
        rule.commit(positions, tokens, torch.ones(len(positions)))
    assert rule.masked.all()
    assert rule.num_final() == 4
