"""What every rule shares: admission, the sampling contract, the chunked logits path,
the commit and its tie rule, and batch invariance (helpers: decoding_harness.py).
"""

from __future__ import annotations

import pytest
import torch

from tests.decoding_harness import (
    CPU,
    EOS,
    EOT,
    IDS,
    MASK,
    NEG_INF,
    Batch,
    TableModel,
    V,
    _one_thread,  # noqa: F401  (autouse: one intra-op thread)
    admit,
    commit_values,
    draws,
    dream_opts,
    inverse_cdf_token,
    kind_of,
    llada_opts,
    logits_table,
    plan_for,
    run_step,
    single,
)
from vllm_dllm.decoding import sampling
from vllm_dllm.decoding.base import PAD, DecodeState, CandidatePlan
from vllm_dllm.decoding.rules import make_rule
from vllm_dllm.decoding.dream import DreamRule
from vllm_dllm.decoding.llada import LLaDARule
from vllm_dllm.decoding.logits import chunked_reduce, rows_per_chunk
from vllm_dllm.options import DREAM, LLADA

# ---------------------------------------------------------------------------
# Construction, admission, the sampling contract
# ---------------------------------------------------------------------------


def test_inverse_cdf_skips_zero_probability_ids_at_a_boundary():
    """u * total exactly on a cumulative boundary: the next id with mass, never a
    zero-probability one (the contract's strict `exceeds`)."""
    probs = torch.tensor([[0.25, 0.0, 0.25, 0.5], [0.0, 0.0, 1.0, 0.0]], dtype=torch.float64)
    u = torch.tensor([0.25, 0.5], dtype=torch.float64)
    assert sampling.inverse_cdf(probs, u).tolist() == [2, 2]
    assert [inverse_cdf_token(probs[r], float(u[r])) for r in range(2)] == [2, 2]
    # Unnormalised rows: u scales the row's total.
    assert sampling.inverse_cdf(probs * 4, u).tolist() == [2, 2]


def test_make_rule_unknown_kind():
    state = DecodeState(1, 4, IDS, CPU)
    with pytest.raises(ValueError, match="nope"):
        make_rule("nope", state)


@pytest.mark.parametrize("opts", [llada_opts(gen=6), dream_opts(gen=6)])
def test_initial_canvas_all_masked_and_padded(opts):
    batch = single(opts)
    assert isinstance(batch.rule, LLaDARule if kind_of(opts) == LLADA else DreamRule)
    batch = admit([(opts, 0)], max_gen=9)
    assert batch.state.canvas[0].tolist() == [MASK] * 6 + [PAD] * 3
    assert int(batch.state.step[0]) == 0
    assert batch.state.num_final(batch.slots, 9).tolist() == [0]


def test_readmitting_a_slot_resets_its_request():
    batch = single(llada_opts(gen=4, steps=2, block=2))
    run_step(batch, batch.slots, TableModel({0: logits_table(4)}))
    assert batch.canvas(0) != [MASK] * 4 and int(batch.state.step[0]) == 1
    batch.state.admit(0, llada_opts(gen=3, steps=3), 1)
    batch.rule.admit(0, llada_opts(gen=3, steps=3))
    assert batch.state.canvas[0].tolist() == [MASK] * 3 + [PAD]
    assert int(batch.state.step[0]) == 0
    plan = plan_for(batch)
    assert plan.candidates[0].tolist() == [True, True, True] and plan.count.tolist() == [1]



# ---------------------------------------------------------------------------
# logits.chunked_reduce
# ---------------------------------------------------------------------------


def make_project(W: torch.Tensor, max_rows: int, calls: list):
    def project(h: torch.Tensor) -> torch.Tensor:
        assert h.shape[0] <= max_rows, (h.shape, max_rows)
        calls.append(h.shape[0])
        return h @ W

    return project


class RecordingRule:
    """Stands in for a rule: records each chunk; confidence encodes the position."""

    def __init__(self):
        self.seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def reduce(self, logits, slots, positions):
        assert logits.shape[0] == slots.shape[0] == positions.shape[0]
        self.seen.append((logits.clone(), slots.clone(), positions.clone()))
        return logits.argmax(-1), logits.max(-1).values + 1000.0 * positions.double()

    def chunks(self, i: int) -> torch.Tensor:
        return torch.cat([chunk[i] for chunk in self.seen])


def integer_valued(*shape, generator) -> torch.Tensor:
    """Small integers in float64: every GEMM partial sum is exact, so the product
    does not depend on the accumulation order (i.e. on the row count)."""
    return torch.randint(-8, 9, shape, generator=generator).double()


def test_chunked_reduce_identical_across_chunk_sizes():
    g = torch.Generator().manual_seed(0)
    n_hidden, H, vocab, n = 57, 12, 33, 41
    hidden = integer_valued(n_hidden, H, generator=g)
    W = integer_valued(H, vocab, generator=g)
    cond_rows = torch.randperm(n_hidden, generator=g)[:n]
    slots = torch.randint(0, 4, (n,), generator=g)
    positions = torch.randint(0, 500, (n,), generator=g)
    ref_logits = hidden[cond_rows] @ W
    ref_tokens = ref_logits.argmax(-1)
    ref_conf = ref_logits.max(-1).values + 1000.0 * positions.double()
    for max_rows in (1, 3, 1000):
        calls, rule = [], RecordingRule()
        tokens, conf = chunked_reduce(hidden, cond_rows, slots, positions,
                                      make_project(W, max_rows, calls), rule, max_rows)
        assert calls == [min(max_rows, n - i) for i in range(0, n, max_rows)]
        assert torch.equal(rule.chunks(0), ref_logits)
        assert rule.chunks(1).tolist() == slots.tolist()
        assert rule.chunks(2).tolist() == positions.tolist()
        assert tokens.tolist() == ref_tokens.tolist()
        assert torch.equal(conf, ref_conf)


def test_chunked_reduce_empty():
    hidden = torch.randn(4, 3)
    called = []
    rule = RecordingRule()
    empty = torch.empty(0, dtype=torch.long)
    tokens, conf = chunked_reduce(hidden, empty, empty, empty, lambda h: called.append(1), rule, 8)
    assert called == [] and rule.seen == []
    assert tokens.shape == (0,) and tokens.dtype == torch.long
    assert conf.shape == (0,) and conf.dtype == torch.float32


@pytest.mark.parametrize("max_rows", [2, 5, 6, 1000])
def test_chunked_reduce_cfg(max_rows):
    """Per-candidate guidance scales; candidates without guidance name their
    conditional row again with scale 0 (as the engine does)."""
    g = torch.Generator().manual_seed(1)
    n, H, vocab = 30, 8, 21
    hidden = integer_valued(2 * n, H, generator=g)
    W = integer_valued(H, vocab, generator=g)
    cond_rows = torch.arange(n)
    guided = torch.arange(n) % 3 != 0
    uncond_rows = torch.where(guided, torch.arange(n, 2 * n), cond_rows)
    cfg = torch.where(guided, torch.tensor([0.5, 2.0, 0.0])[torch.arange(n) % 3], 0.0).double()
    positions = torch.arange(n) * 3
    slots = torch.arange(n) % 4
    calls, rule = [], RecordingRule()
    tokens, conf = chunked_reduce(hidden, cond_rows, slots, positions,
                                  make_project(W, max_rows, calls), rule, max_rows,
                                  uncond_rows=uncond_rows, cfg_scale=cfg)
    per_chunk = max_rows // 2
    assert rows_per_chunk(max_rows, 2) == per_chunk
    assert [p.shape[0] for _, _, p in rule.seen] == [min(per_chunk, n - i) for i in range(0, n, per_chunk)]
    assert calls == [2 * p.shape[0] for _, _, p in rule.seen]
    cond, un = hidden[cond_rows] @ W, hidden[uncond_rows] @ W
    expected = un + (cfg[:, None] + 1) * (cond - un)  # exact: integer-valued operands
    got = rule.chunks(0)
    assert torch.equal(got, expected)
    assert torch.equal(got[~guided], cond[~guided])
    assert not torch.equal(got[guided], cond[guided])  # guidance did change the guided rows
    assert tokens.tolist() == expected.argmax(-1).tolist()
    assert rule.chunks(1).tolist() == slots.tolist()
    assert rule.chunks(2).tolist() == positions.tolist()


def test_chunked_reduce_cfg_unguided_row_is_cond_exactly():
    """cond == uncond row with scale 0: un + 1 * (cond - un) is exactly cond, for any
    float values, when the projection is an exact function of each row."""
    g = torch.Generator().manual_seed(4)
    n = 9
    hidden = torch.randn(n, V, generator=g) * 7
    rule = RecordingRule()
    rows = torch.arange(n)
    chunked_reduce(hidden, rows, rows, rows, lambda h: h * 1.0, rule, 4,
                   uncond_rows=rows, cfg_scale=torch.zeros(n))
    assert torch.equal(rule.chunks(0), hidden)


def test_rows_per_chunk():
    assert rows_per_chunk(1024, 1) == 1024
    assert rows_per_chunk(1024, 2) == 512
    assert rows_per_chunk(7, 2) == 3
    assert rows_per_chunk(1, 1) == 1
    with pytest.raises(ValueError, match="cannot hold 2 rows"):
        rows_per_chunk(1, 2)


def test_chunked_reduce_cfg_max_rows_too_small_raises():
    hidden = torch.randn(4, 3, dtype=torch.float64)
    W = torch.randn(3, 5, dtype=torch.float64)
    calls = []
    with pytest.raises(ValueError, match="cannot hold 2 rows"):
        chunked_reduce(hidden, torch.arange(2), torch.zeros(2, dtype=torch.long), torch.arange(2),
                       make_project(W, 1, calls), RecordingRule(), 1,
                       uncond_rows=torch.arange(2, 4), cfg_scale=torch.ones(2))
    assert calls == []


# Relative tolerance on confidences across chunk sizes and batch compositions when
# the LM head is a float32 GEMM.  A GEMM's accumulation order (blocking, vector
# kernel, edge handling) may change with its row count, so the same hidden row can
# give logits that differ in the last bits: each logit by at most ~H * 2**-24 *
# sum_k |h_k w_k| (the dot-product error bound), ~1e-6 relative in practice (seen
# on AMD EPYC).  A confidence p = exp(l_tok - logsumexp(l)) moves by at most twice
# the largest logit change, relatively.  1e-5 leaves an order of magnitude; the
# test checks that the data's worst-case bound is below it.
GEMM_CONF_RTOL = 1e-5


def _gemm_batch(target_alone: bool, T: float):
    target = (llada_opts(gen=24, steps=6, block=12, T=T, conf_inf=True), 5)
    others = [(llada_opts(gen=16, steps=4, T=0.3), 6), (llada_opts(gen=32, steps=8, block=8, remasking="random"), 7)]
    if target_alone:
        return admit([target], slots=[1], capacity=3), 1
    return admit([others[0], target, others[1]], slots=[2, 1, 0]), 1


@pytest.mark.parametrize("T", [0.0, 0.9])
def test_chunked_reduce_through_llada_rule_gemm_tolerance(T):
    """The invariance we promise with a real LM head (hidden @ W in float32):

    * tokens are identical across chunk sizes and batch compositions (given logits
      whose decisions are not within rounding of a tie; checked on the data);
    * confidences agree to GEMM_CONF_RTOL relative: float32 GEMM accumulation order
      may change with the row count, ~1e-6 relative;
    * with a projection that is an exact function of each row (designed logits, no
      GEMM) they are exactly equal: see test_chunked_reduce_exact_projection_is_invariant
      and the batch-invariance tests.
    """
    g = torch.Generator().manual_seed(2)
    H, n_requests = 8, 3
    hidden_of = torch.randn(n_requests, 32, H, generator=g)  # per (slot, position)
    W = torch.randn(H, V, generator=g) * 0.3
    exact = hidden_of.double() @ W.double()
    bound = 2 * 2 * H * 2.0**-24 * (hidden_of.abs().double() @ W.abs().double()).amax()
    assert bound < GEMM_CONF_RTOL  # the tolerance covers the data's worst case
    # Decisions are far from rounding: top-2 gaps of the (noisy) scores.
    logits = exact[1, :12]  # the target's first-block positions (slot 1, seed 5)
    if T == 0:
        top2 = logits.topk(2, dim=-1).values
        assert (top2[:, 0] - top2[:, 1]).min() > 100 * bound
    else:
        # A logit change d moves the cumulative probabilities by at most ~2d / T.
        u = draws(5, 0, range(12), sampling.LLADA_SAMPLE, torch.float64)
        cdf = torch.cumsum(torch.softmax(logits / T, -1), -1)
        assert (cdf - u).abs().min() > 100 * bound / T

    results = {}
    for alone in (True, False):
        for max_rows in (1, 5, 64):
            batch, target = _gemm_batch(alone, T)
            slots = batch.slots
            batch.rule.prepare(slots)
            width = int(batch.state.gen_length[slots].max())
            plan = batch.rule.plan(slots, width)
            rows, positions = plan.candidates.nonzero(as_tuple=True)
            cand_slots = slots[rows]
            hidden = hidden_of[cand_slots, positions]
            tokens, conf = chunked_reduce(hidden, torch.arange(len(rows)), cand_slots, positions,
                                          make_project(W, max_rows, []), batch.rule, max_rows)
            mine = cand_slots == target
            results[alone, max_rows] = (positions[mine], tokens[mine], conf[mine])
    ref_pos, ref_tokens, ref_conf = results[True, 64]
    assert ref_pos.tolist() == list(range(12))
    for pos, tokens, conf in results.values():
        assert torch.equal(pos, ref_pos)
        assert torch.equal(tokens, ref_tokens)
        assert torch.allclose(conf, ref_conf, rtol=GEMM_CONF_RTOL, atol=0)


def test_chunked_reduce_exact_projection_is_invariant():
    """With an exact per-row projection, confidences are bit-identical across chunk
    sizes and batch compositions (softmax and draws are row-local)."""
    g = torch.Generator().manual_seed(3)
    hidden_of = torch.randn(3, 32, V, generator=g) * 3
    for T in (0.0, 0.9):
        results = []
        for alone in (True, False):
            for max_rows in (1, 5, 64):
                batch, target = _gemm_batch(alone, T)
                model = TableModel({s: hidden_of[s] for s in range(3)})
                rec = run_step(batch, batch.slots, model, max_rows=max_rows)
                mine = batch.slots[rec.rows] == target
                results.append((rec.positions[mine], rec.tokens[mine], rec.conf[mine]))
        for pos, tokens, conf in results[1:]:
            assert torch.equal(pos, results[0][0])
            assert torch.equal(tokens, results[0][1])
            assert torch.equal(conf, results[0][2])


# ---------------------------------------------------------------------------
# Commit: ties, finality
# ---------------------------------------------------------------------------


def _tie_table(gen: int, peak: int) -> torch.Tensor:
    """Identical logits rows (equal confidences) except a sharper row at `peak`."""
    table = torch.zeros(gen, V)
    table[:, 7] = 2.0
    table[peak, 7] = 4.0
    return table


@pytest.mark.parametrize("kind", [LLADA, DREAM])
def test_ties_break_toward_lower_position_alone_and_batched(kind):
    """Equal confidences: the lowest positions are committed, whatever else shares
    the batch (and whichever slot/row the request has)."""
    gen = 8
    if kind == LLADA:
        target = llada_opts(gen=gen, steps=2, block=gen)  # commits 4, then 4
        others = [llada_opts(gen=12, steps=3, T=0.8), llada_opts(gen=4, steps=4, remasking="random")]
        count = 4
    else:
        target = dream_opts(gen=gen, steps=2)  # commits int(8 * (1 - s/t)) = 3, then 5
        others = [dream_opts(gen=12, steps=3, T=0.8, top_k=3), dream_opts(gen=4, alg="origin")]
        count = 3
    table = _tie_table(gen, peak=5)
    other_tables = {s: logits_table(g, seed=s) for s, g in ((0, 12), (2, 4))}
    alone = single(target)
    batched = admit([(others[0], 1), (target, 0), (others[1], 2)], slots=[0, 1, 2])
    rec_alone = run_step(alone, alone.slots, TableModel({0: table}))
    rec_batch = run_step(batched, torch.tensor([2, 1, 0]), TableModel({1: table, **other_tables}), max_rows=3)
    assert rec_alone.plan.count.tolist() == [count]
    assert rec_alone.newly() == sorted([5] + list(range(count - 1)))  # the peak, then 0, 1, ...
    assert rec_batch.newly(row=1) == rec_alone.newly()
    assert batched.canvas(1) == alone.canvas(0)


def test_commit_ranks_minus_inf_candidates_last_and_never_non_candidates():
    """A candidate whose confidence is -inf still commits when the count needs it
    (below every finite one, ties toward the lower position); non-candidates never."""
    batch = single(llada_opts(gen=6, steps=1))  # one step: commits all 6 candidates
    plan = plan_for(batch)
    plan = CandidatePlan(candidates=plan.candidates & torch.tensor([True, True, False, True, True, True]),
                    count=torch.tensor([4]))
    tokens = torch.tensor([[10, 11, 12, 13, 14, 15]])
    # The grid holds a high confidence at the non-candidate: the rule must ignore it.
    conf = torch.tensor([[NEG_INF, 0.5, 0.9, NEG_INF, NEG_INF, 0.1]])
    batch.rule.commit(batch.slots, plan, tokens, conf)
    # Finite: 1, 5; then -inf candidates in position order: 0, 3.  Position 2 is no candidate.
    assert batch.canvas(0) == [10, 11, MASK, 13, MASK, 15]


@pytest.mark.parametrize("opts", [llada_opts(gen=4, steps=4, block=4), dream_opts(gen=4, steps=4)])
def test_a_canvas_is_final_after_its_steps_even_if_a_mask_was_committed(opts):
    """The references return the canvas after `steps` steps whatever it holds; a
    position committed as the mask id itself must not keep the request alive."""
    batch = single(opts)
    steps = opts.steps
    for step in range(steps):
        assert batch.state.num_final(batch.slots, 4).tolist() == [0]
        plan = plan_for(batch)
        commit_values(batch, plan, [MASK] * 4, [1.0] * 4)
    assert batch.masked(0).all()
    assert batch.state.num_final(batch.slots, 4).tolist() == [4]


# ---------------------------------------------------------------------------
# Batch invariance: a request decodes the same alone and among others
# ---------------------------------------------------------------------------


def decode_history(batch: Batch, target: int, model: TableModel, max_rows: int,
                   delay: dict[int, int] | None = None) -> list[list[int]]:
    """Run every admitted request to its last step (finished ones leave the batch);
    returns the target's canvas after each of its steps.

    Slot s joins at iteration delay[s] (so requests sit at different denoising
    steps), and the batch's row order rotates every iteration (so batch-level
    facts taken from "the first row" and per-row parameters would show)."""
    delay = delay or {}
    history = []
    iteration = 0
    while len(batch.unfinished()):
        slots = [s for s in batch.unfinished().tolist() if delay.get(s, 0) <= iteration]
        shift = iteration % max(1, len(slots))
        slots = torch.tensor(slots[shift:] + slots[:shift], dtype=torch.long)
        if len(slots):
            run_step(batch, slots, model, max_rows=max_rows)
            if target in slots.tolist():
                history.append(batch.canvas(target))
        iteration += 1
    return history


def _request_table(key: int, gen: int) -> torch.Tensor:
    table = logits_table(gen, seed=100 + key, scale=2.0)
    table[::3, EOS] += 3.0
    table[1::5, EOT] += 3.0
    return table


def _check_batch_invariance(target, others):
    """`target` (options, seed) decoded alone in slot 0 and in slot 1 between two
    `others`, with logits that depend only on (request, position)."""
    (t_opts, _), gens = target, [o.gen_length for o, _ in others]
    t_table = _request_table(0, t_opts.gen_length)
    alone = admit([target])
    solo = decode_history(alone, 0, TableModel({0: t_table}), max_rows=1024)
    assert len(solo) == t_opts.steps
    assert MASK not in solo[-1]
    model = TableModel({0: _request_table(1, gens[0]), 1: t_table, 2: _request_table(2, gens[1])})
    # One chunk per step (every row shares a reduce call with the other requests),
    # and 3-row chunks that cut across requests; the target joins two steps late.
    for max_rows in (1024, 3):
        batched = admit([others[0], target, others[1]], max_gen=40)
        together = decode_history(batched, 1, model, max_rows=max_rows, delay={1: 2, 2: 1})
        assert len(together) == t_opts.steps
        for step, (a, b) in enumerate(zip(solo, together)):
            assert a == b, (max_rows, step)
        # Padding past each canvas is never written.
        for slot, gen in ((0, gens[0]), (1, t_opts.gen_length), (2, gens[1])):
            assert (batched.state.canvas[slot, gen:] == PAD).all()
    return solo


LLADA_TARGETS = [
    (llada_opts(gen=12, steps=6, block=4, T=0.7), 5),
    (llada_opts(gen=12, steps=12, block=6, T=0.0, conf_inf=True), 5),
    (llada_opts(gen=8, steps=4, block=8, T=1.0, remasking="random", logits_eos_inf=True), 5),
]
LLADA_OTHERS = [
    (llada_opts(gen=20, steps=10, block=10, T=0.0, remasking="random"), 7),
    (llada_opts(gen=16, steps=16, block=2, T=1.3, conf_inf=True, logits_eos_inf=True), 9),
]


@pytest.mark.parametrize("target", LLADA_TARGETS, ids=["T0.7", "T0-conf_inf", "random-T1"])
def test_llada_batch_invariance(target):
    history = _check_batch_invariance(target, LLADA_OTHERS)
    # Not vacuous: the canvas changed at every step that had a count.
    assert all(a != b for a, b in zip([[MASK] * len(history[0])] + history, history))


DREAM_TARGETS = [
    (dream_opts(gen=16, steps=8, alg="entropy", alg_temp=0.5, T=0.6), 5),
    (dream_opts(gen=16, steps=16, alg="origin", T=0.9, top_p=0.9), 5),
    (dream_opts(gen=12, steps=4, alg="maskgit_plus", T=0.0, top_k=3), 5),
    (dream_opts(gen=12, steps=6, alg="topk_margin", T=0.0), 5),
]
DREAM_OTHERS = [
    (dream_opts(gen=24, steps=24, alg="origin", T=0.0), 7),
    (dream_opts(gen=10, steps=5, alg="topk_margin", alg_temp=1.0, T=1.0, top_k=4, top_p=0.8), 9),
]


@pytest.mark.parametrize("target", DREAM_TARGETS, ids=["entropy-alg_temp", "origin-top_p", "top_k-T0", "margin-T0"])
def test_dream_batch_invariance(target):
    history = _check_batch_invariance(target, DREAM_OTHERS)
    assert len({tuple(h) for h in history}) > 1
