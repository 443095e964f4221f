"""LLaDA's batched rule on designed logits: transfer schedule, candidates, commit,
blocks, the EOS switches, sampling and random remasking (helpers: decoding_harness.py).
"""

from __future__ import annotations

import pytest
import torch

from tests.decoding_harness import (
    EOS,
    EOT,
    IDS,
    MASK,
    NEG_INF,
    TableModel,
    V,
    _one_thread,  # noqa: F401  (autouse: one intra-op thread)
    admit,
    commit_values,
    draws,
    expected_top,
    inverse_cdf_token,
    llada_opts,
    logits_table,
    plan_for,
    reduce_rows,
    run_step,
    single,
)
from vllm_dllm.decoding import sampling
from vllm_dllm.decoding.base import SpecialIds
from vllm_dllm.decoding.llada import transfer_count
from vllm_dllm.decoding import philox
from vllm_dllm.options import LLaDAOptions

# ---------------------------------------------------------------------------
# LLaDA: transfer counts, candidates, commit, blocks
# ---------------------------------------------------------------------------


def test_transfer_count_matches_spec():
    ms, ss = torch.meshgrid(torch.arange(70), torch.arange(1, 20), indexing="ij")
    ms, ss = ms.flatten(), ss.flatten()
    per_step = torch.stack([transfer_count(ms, ss, torch.full_like(ms, i)) for i in range(19)], dim=1)
    for m, s, counts in zip(ms.tolist(), ss.tolist(), per_step.tolist()):
        counts = counts[:s]
        assert counts == [m // s + (1 if i < m % s else 0) for i in range(s)]
        assert sum(counts) == m
        assert counts == sorted(counts, reverse=True)


def test_transfer_count_hand_values():
    def counts(m, s):
        return transfer_count(torch.full((s,), m), torch.full((s,), s), torch.arange(s)).tolist()

    assert counts(32, 32) == [1] * 32
    assert counts(10, 4) == [3, 3, 2, 2]
    assert counts(3, 5) == [1, 1, 1, 0, 0]
    assert counts(0, 3) == [0, 0, 0]


def test_llada_candidates_only_masked_positions_of_current_block():
    batch = single(llada_opts(gen=8, steps=4, block=4))  # 2 blocks, 2 steps per block
    plan = plan_for(batch)
    assert plan.candidates[0].nonzero().flatten().tolist() == [0, 1, 2, 3]
    assert plan.count.tolist() == [2]
    # Commit positions 1 and 3 (the two most confident).
    commit_values(batch, plan, [10, 11, 12, 13, 14, 15, 16, 17], [0.1, 0.9, 0.2, 0.8, 1, 1, 1, 1])
    assert batch.canvas(0) == [MASK, 11, MASK, 13] + [MASK] * 4
    plan = plan_for(batch)
    assert plan.candidates[0].nonzero().flatten().tolist() == [0, 2]
    assert plan.count.tolist() == [2]
    commit_values(batch, plan, [7, 0, 8, 0, 0, 0, 0, 0], [0.5, 0, 0.4, 0, 0, 0, 0, 0])
    assert batch.canvas(0)[:4] == [7, 11, 8, 13]
    # Block 0 is full after steps_per_block steps: block 1 now.
    plan = plan_for(batch)
    assert plan.candidates[0].nonzero().flatten().tolist() == [4, 5, 6, 7]


def test_llada_commit_writes_scheduled_count_most_confident():
    gen, steps = 10, 4  # one block: counts [3, 3, 2, 2]
    batch = single(llada_opts(gen=gen, steps=steps))
    g = torch.Generator().manual_seed(3)
    for step, expected_count in enumerate([3, 3, 2, 2]):
        plan = plan_for(batch)
        assert plan.count.tolist() == [expected_count]
        candidates = plan.candidates[0].nonzero().flatten().tolist()
        assert candidates == batch.masked(0).nonzero().flatten().tolist()
        conf = torch.rand(gen, generator=g)
        tokens = torch.arange(gen) + 100 * (step + 1)
        before = batch.canvas(0)
        commit_values(batch, plan, tokens, conf)
        changed = [p for p in range(gen) if batch.canvas(0)[p] != before[p]]
        assert changed == expected_top(conf, candidates, expected_count)
        assert [batch.canvas(0)[p] for p in changed] == tokens[changed].tolist()
    assert not batch.masked(0).any()


def test_llada_num_final_is_committed_prefix():
    batch = admit([(llada_opts(gen=6, steps=3), 0)], max_gen=9)  # counts [2, 2, 2]
    plan = plan_for(batch)
    commit_values(batch, plan, torch.arange(6) + 20, [0, 0.9, 0.8, 0, 0, 0])
    assert batch.canvas(0)[:3] == [MASK, 21, 22]
    assert batch.state.num_final(batch.slots, 6).tolist() == [0]
    plan = plan_for(batch)
    assert plan.candidates[0].nonzero().flatten().tolist() == [0, 3, 4, 5]
    commit_values(batch, plan, [30, 0, 0, 33, 34, 35], [0.9, 0, 0, 0.1, 0.2, 0.8])
    assert batch.canvas(0) == [30, 21, 22, MASK, MASK, 35]
    assert batch.state.num_final(batch.slots, 6).tolist() == [3]
    # A wider batch (padding past the canvas) does not change the prefix.
    assert batch.state.num_final(batch.slots, 9).tolist() == [3]
    plan = plan_for(batch)
    commit_values(batch, plan, [0, 0, 0, 43, 44, 0], [0, 0, 0, 0.5, 0.5, 0])
    assert batch.state.num_final(batch.slots, 6).tolist() == [6]
    assert batch.state.num_final(batch.slots, 9).tolist() == [6]  # not the batch width


def test_num_final_of_a_canvas_filled_before_its_last_step():
    batch = admit([(llada_opts(gen=2, steps=4, block=2), 0)], max_gen=5)  # counts [1, 1, 0, 0]
    model = TableModel({0: logits_table(2)})
    finals = []
    for _ in range(4):
        run_step(batch, batch.slots, model)
        finals.append(batch.state.num_final(batch.slots, 5).tolist())
    assert finals[1:] == [[2], [2], [2]] and finals[0] in ([0], [1])
    assert int(batch.state.step[0]) == 4 and not batch.masked(0).any()
    assert not batch.masked(0).any()


def reference_llada_step(x, table, opts: LLaDAOptions, ids: SpecialIds, block: int):
    """One step of MODEL_SPEC.md section 3 LLaDA (T=0, low_confidence) on canvas x.

    Returns the candidates x0 and the confidence vector (-inf off the masked
    positions of the block)."""
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
    return x0, conf


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
    """Each step commits the reference's count and tokens, and its top-k set.

    Where the top-k cut falls on a tie (systematic with confidence_eos_eot_inf:
    every EOS/EoT-argmax position has confidence exactly 0) the lower positions win
    (the references' torch.topk order among ties is unspecified)."""
    opts = llada_opts(gen=gen, steps=steps, block=block, **flags)
    ties = 0
    for seed in range(4):
        table = logits_table(gen, seed=seed)
        # Make EOS/EoT frequent argmaxes so the flags matter.
        table[::3, EOS] += 6.0
        table[1::4, EOT] += 6.0
        batch = single(opts)
        model = TableModel({0: table})
        counts: list[int] = []
        for step in range(steps):
            block_idx, i = divmod(step, opts.steps_per_block)
            lo, hi = block_idx * block, (block_idx + 1) * block
            x = torch.tensor(batch.canvas(0))
            if i == 0:
                m = int((x[lo:hi] == MASK).sum())
                counts = [m // opts.steps_per_block + (j < m % opts.steps_per_block)
                          for j in range(opts.steps_per_block)]
            x0, conf = reference_llada_step(x, table, opts, IDS, block_idx)

            rec = run_step(batch, batch.slots, model)
            # Only the masked positions of the current block need logits.
            assert rec.positions.tolist() == [p for p in range(lo, hi) if x[p] == MASK]
            assert rec.plan.count.tolist() == [counts[i]]
            assert rec.tokens.tolist() == x0[rec.positions].tolist()
            assert torch.allclose(rec.conf, conf[rec.positions], rtol=1e-6, atol=0)

            newly = rec.newly()
            assert len(newly) == counts[i], (seed, step)
            assert rec.after[0, newly].tolist() == x0[newly].tolist()
            assert (rec.after[0, hi:] == MASK).all()  # nothing beyond the block
            k = counts[i]
            if k:
                candidates = rec.positions.tolist()
                assert newly == expected_top(conf, candidates, k)
                vals = conf.sort(descending=True).values
                tied = k < len(vals) and vals[k - 1] == vals[k]
                ties += bool(tied)
                if not tied:
                    assert newly == sorted(torch.topk(conf, k).indices.tolist()), (seed, step)
        assert not batch.masked(0).any()
        assert batch.state.num_final(batch.slots, gen).tolist() == [gen]
    if flags.get("conf_inf"):
        assert ties > 0  # the designed table does exercise the zero-confidence ties


def test_llada_block_advances_after_steps_per_block():
    batch = single(llada_opts(gen=12, steps=6, block=4))  # 3 blocks, 2 steps each
    model = TableModel({0: logits_table(12)})
    for step in range(6):
        rec = run_step(batch, batch.slots, model)
        blk = step // 2
        assert all(blk * 4 <= p < (blk + 1) * 4 for p in rec.positions.tolist())
        assert len(rec.positions) == (4 if step % 2 == 0 else 2)
        if step % 2 == 1:
            canvas = torch.tensor(batch.canvas(0))
            assert (canvas[: (blk + 1) * 4] != MASK).all()
            assert (canvas[(blk + 1) * 4:] == MASK).all()
    assert not batch.masked(0).any()


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


POS = [0, 1, 2, 3]


def test_confidence_eos_eot_inf_at_t0():
    rows = designed_rows()
    batch = single(llada_opts(gen=4, steps=2, conf_inf=True))  # commits 2 per step
    rec = run_step(batch, batch.slots, TableModel({0: rows}))
    tokens, conf = rec.tokens, rec.conf
    # The argmax is taken before the columns are removed.
    assert tokens.tolist() == [EOS, EOT, 9, 10]
    # Positions whose argmax is EOS or EoT get confidence 0 (their column is -inf).
    assert conf[0].item() == 0.0 and conf[1].item() == 0.0
    # Others are renormalised without the EOS/EoT mass.
    for r, tok in ((2, 9), (3, 10)):
        assert conf[r].item() == pytest.approx(softmax_without(rows[r], [EOS, EOT], tok), rel=1e-6)
    assert conf[2].item() > float(torch.softmax(rows[2], -1)[9]) + 0.1
    # So the committed token is never EOS/EoT when anything else is available.
    assert batch.canvas(0) == [MASK, MASK, 9, 10]


def test_without_flag_eos_keeps_its_confidence():
    rows = designed_rows()
    batch = single(llada_opts(gen=4))
    tokens, conf = reduce_rows(batch, rows, POS)
    assert tokens.tolist() == [EOS, EOT, 9, 10]
    for r, tok in enumerate(tokens.tolist()):
        assert conf[r].item() == pytest.approx(float(torch.softmax(rows[r], -1)[tok]), rel=1e-6)


def test_confidence_eos_eot_inf_at_positive_t_removes_only_eot():
    # T small enough that the Gumbel factor (in [~0.6, ~1.07]) cannot flip a 3-nat gap.
    rows = designed_rows()
    for seed in range(5):
        batch = single(llada_opts(gen=4, T=0.01, conf_inf=True), seed=seed)
        tokens, conf = reduce_rows(batch, rows, POS)
        assert tokens.tolist() == [EOS, EOT, 9, 10]
        # EOS keeps its mass; EoT's column is gone.
        assert conf[0].item() == pytest.approx(softmax_without(rows[0], [EOT], EOS), rel=1e-6)
        assert conf[0].item() > 0.8
        assert conf[1].item() == 0.0
        assert conf[2].item() == pytest.approx(softmax_without(rows[2], [EOT], 9), rel=1e-6)
        assert conf[3].item() == pytest.approx(softmax_without(rows[3], [EOT], 10), rel=1e-6)


def test_confidence_eos_eot_inf_per_row_temperature_in_one_batch():
    """T == 0 and T > 0 requests side by side: each row follows its own temperature."""
    rows = designed_rows()
    batch = admit([(llada_opts(gen=4, T=0.0, conf_inf=True), 0), (llada_opts(gen=4, T=0.01, conf_inf=True), 0)])
    batch.rule.prepare(batch.slots)
    slots = torch.tensor([0, 0, 1, 1])
    tokens, conf = batch.rule.reduce(torch.cat([rows[:2], rows[:2]]), slots, torch.tensor([0, 1, 0, 1]))
    assert tokens.tolist() == [EOS, EOT, EOS, EOT]
    assert conf[0].item() == 0.0  # T == 0: EOS removed too
    assert conf[2].item() == pytest.approx(softmax_without(rows[0], [EOT], EOS), rel=1e-6)
    assert conf[1].item() == conf[3].item() == 0.0


def test_confidence_eos_eot_inf_without_eot_id():
    rows = designed_rows()
    ids = SpecialIds(mask=MASK, eos=EOS, eot=None)
    batch = single(llada_opts(gen=4, conf_inf=True), ids=ids)
    _, conf = reduce_rows(batch, rows, POS)
    assert conf[0].item() == 0.0
    assert conf[1].item() == pytest.approx(softmax_without(rows[1], [EOS], EOT), rel=1e-6)
    assert conf[2].item() == pytest.approx(softmax_without(rows[2], [EOS], 9), rel=1e-6)


@pytest.mark.parametrize("T", [0.0, 0.01, 1.0])
def test_logits_eos_inf_never_chooses_eos(T):
    rows = designed_rows()
    rows[:, EOS] = 30.0  # EOS dominates every row
    for seed in range(4):
        batch = single(llada_opts(gen=4, T=T, logits_eos_inf=True), seed=seed)
        tokens, conf = reduce_rows(batch, rows, POS)
        assert EOS not in tokens.tolist()
        assert torch.isfinite(conf).all() and (conf > 0).all()
        if T == 0:
            assert tokens.tolist() == [7, EOT, 9, 10]
            assert conf[0].item() == pytest.approx(softmax_without(rows[0], [EOS], 7), rel=1e-6)
    # Without the flag EOS wins everywhere: the flag is what removes it.
    batch = single(llada_opts(gen=4, T=T), seed=0)
    assert reduce_rows(batch, rows, POS)[0].tolist() == [EOS] * 4


def test_llada_sampling_matches_contract_and_is_chunk_invariant():
    """At T > 0 a token is the inverse-CDF draw from softmax(logits / T) in float64
    (the distribution of the reference's Gumbel-max), with u the float64
    LLADA_SAMPLE draw of (seed, step, position); see decoding/sampling.py."""
    gen, T, seed = 6, 0.7, 11
    table = logits_table(gen, seed=5, scale=1.0)
    model = TableModel({0: table})
    records = []
    for max_rows in (1, 4, 1024):
        batch = single(llada_opts(gen=gen, T=T), seed=seed)
        records.append(run_step(batch, batch.slots, model, max_rows=max_rows))
    rec = records[0]
    assert rec.positions.tolist() == list(range(gen))
    u = draws(seed, 0, range(gen), sampling.LLADA_SAMPLE, torch.float64)[:, 0]
    probs = torch.softmax(table.double() / T, -1)
    expected = [inverse_cdf_token(probs[pos], float(u[pos])) for pos in range(gen)]
    assert rec.tokens.tolist() == expected
    assert rec.tokens.tolist() != table.argmax(-1).tolist()  # the draw did matter
    for pos in range(gen):
        assert rec.conf[pos].item() == pytest.approx(
            float(torch.softmax(table[pos], -1)[rec.tokens[pos]]), rel=1e-6)
    # Chunking (1 row, 4 rows, all rows) never changes a draw: keys are positions.
    for other in records[1:]:
        assert torch.equal(other.tokens, rec.tokens) and torch.equal(other.conf, rec.conf)
        assert torch.equal(other.after, rec.after)
    # Out-of-order rows get their own position's draws.
    batch = single(llada_opts(gen=gen, T=T), seed=seed)
    t, c = reduce_rows(batch, table[[4, 0, 2]], [4, 0, 2])
    assert t.tolist() == rec.tokens[[4, 0, 2]].tolist()
    assert torch.equal(c, rec.conf[[4, 0, 2]])
    # A different seed, or a later step, gives different draws somewhere.
    hot = table * 0.05  # flat logits: the draw decides
    base = reduce_rows(single(llada_opts(gen=gen, T=T), seed=seed), hot, range(gen))[0]
    other_seed = reduce_rows(single(llada_opts(gen=gen, T=T), seed=seed + 1), hot, range(gen))[0]
    later = single(llada_opts(gen=gen, T=T), seed=seed)
    later.state.step[0] = 1
    other_step = reduce_rows(later, hot, range(gen))[0]
    assert base.tolist() != other_seed.tolist()
    assert base.tolist() != other_step.tolist()


def test_llada_random_remasking_confidence():
    gen, seed = 5, 9
    batch = single(llada_opts(gen=gen, remasking="random"), seed=seed)
    table = logits_table(gen)
    tokens, conf = reduce_rows(batch, table, range(gen))
    assert tokens.tolist() == table.argmax(-1).tolist()
    expected = draws(seed, 0, range(gen), sampling.REMASK, torch.float32)[:, 0]
    assert conf.dtype == torch.float32
    assert conf.tolist() == expected.tolist()
    assert ((conf > 0) & (conf < 1)).all()
    # At step 1 the draws are those of step 1.
    batch.state.step[0] = 1
    _, conf1 = reduce_rows(batch, table, range(gen))
    assert conf1.tolist() == draws(seed, 1, range(gen), sampling.REMASK, torch.float32)[:, 0].tolist()
    assert conf1.tolist() != conf.tolist()


def test_philox_seed_is_reduced_mod_2_64():
    """DecodeState keeps the seed's 64 bits as the contract says (s = seed mod 2**64,
    stored in int64 by two's complement): seeds that differ only in bit 63 draw
    differently, and a negative seed draws as seed + 2**64."""
    gen = 3
    seeds = [5, 5 + 2**63, -7, 2**64 - 7]
    batch = admit([(llada_opts(gen=gen, remasking="random"), s) for s in seeds])
    batch.rule.prepare(batch.slots)
    slots = batch.slots.repeat_interleave(gen)
    positions = torch.arange(gen).repeat(len(seeds))
    _, conf = batch.rule.reduce(torch.zeros(len(slots), V), slots, positions)
    conf = conf.view(len(seeds), gen)
    for row, seed in enumerate(seeds):
        s = seed % 2**64
        key = torch.tensor([s & 0xFFFFFFFF, s >> 32])
        counter = torch.stack(
            [torch.zeros(gen, dtype=torch.long), torch.arange(gen), torch.zeros(gen, dtype=torch.long),
             torch.full((gen,), sampling.REMASK)], dim=1)
        x0 = philox.philox4x32_10(counter, key)[:, 0]
        expected = (((x0 >> 8).to(torch.float32) + 0.5) * 2.0**-24).tolist()
        assert conf[row].tolist() == expected, seed
    assert conf[0].tolist() != conf[1].tolist()
    assert conf[2].tolist() == conf[3].tolist()
