"""Unit tests for the batched decoding rules in vllm_dllm/decoding/.

Designed logits over a tiny vocabulary, no model and no engine.  The mask id lies
outside the vocabulary so a candidate token can never be mistaken for a mask.

`run_step` below reproduces the engine's per-step data flow (StepEngine.step) with
a "model" that is a table of logits per (request, canvas position): prepare ->
plan -> the candidates' logits through chunked_reduce (which calls rule.reduce
per chunk) -> tokens/confidences scattered into [R, width] grids -> commit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from vllm_dllm.decoding import sampling
from vllm_dllm.decoding.base import PAD, DecodeState, SpecialIds, StepPlan, make_rule
from vllm_dllm.decoding.dream import DreamRule, filter_top_p_top_k, unmask_fractions
from vllm_dllm.decoding.llada import LLaDARule, transfer_count
from vllm_dllm.decoding.logits import chunked_reduce, rows_per_chunk
from vllm_dllm.engine import philox
from vllm_dllm.options import DREAM, LLADA, DreamOptions, LLaDAOptions

V = 16
MASK = 1000
EOS = 3
EOT = 5
IDS = SpecialIds(mask=MASK, eos=EOS, eot=EOT)
NEG_INF = float("-inf")
CPU = torch.device("cpu")
LOWEST32 = torch.finfo(torch.float32).min


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: intra-op threads only add contention on a loaded 2-core CPU."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---------------------------------------------------------------------------
# Helpers: options, a batch of requests, one engine-like step
# ---------------------------------------------------------------------------


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


def kind_of(opts) -> str:
    return LLADA if isinstance(opts, LLaDAOptions) else DREAM


@dataclass
class Batch:
    state: DecodeState
    rule: LLaDARule | DreamRule
    slots: torch.Tensor  # the admitted slots, in admission order

    def canvas(self, slot: int) -> list[int]:
        """The request's canvas (its generation length, no padding)."""
        return self.state.canvas[slot, : int(self.state.gen_length[slot])].tolist()

    def masked(self, slot: int) -> torch.Tensor:
        return torch.tensor(self.canvas(slot)) == MASK

    def unfinished(self) -> torch.Tensor:
        """Admitted slots that still have steps to run (what a scheduler would run)."""
        s = self.state
        return self.slots[s.step[self.slots] < s.steps[self.slots]]


def admit(requests, *, slots=None, capacity=None, max_gen=None, ids=IDS) -> Batch:
    """A DecodeState and its rule with `requests` [(options, seed)] admitted, request
    i into slot `slots[i]` (default i)."""
    kinds = {kind_of(o) for o, _ in requests}
    assert len(kinds) == 1
    slots = list(range(len(requests))) if slots is None else list(slots)
    capacity = capacity or max(slots) + 1
    max_gen = max_gen or max(o.gen_length for o, _ in requests)
    state = DecodeState(capacity, max_gen, ids, CPU)
    rule = make_rule(kinds.pop(), state)
    for slot, (opts, seed) in zip(slots, requests):
        state.admit(slot, opts, seed)
        rule.admit(slot, opts)
    return Batch(state, rule, torch.tensor(slots, dtype=torch.long))


def single(opts, seed=0, ids=IDS) -> Batch:
    return admit([(opts, seed)], ids=ids)


class TableModel:
    """Designed logits: an exact function of (slot, canvas position), never of the
    canvas, the batch or the chunking.  `tables[slot]` is [gen_length, V]."""

    def __init__(self, tables: dict[int, torch.Tensor]):
        self.tables = tables

    def __call__(self, cand_slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if len(cand_slots) == 0:
            return torch.empty(0, V)
        return torch.stack([self.tables[s][p] for s, p in zip(cand_slots.tolist(), positions.tolist())])


def logits_table(gen, seed=0, scale=3.0) -> torch.Tensor:
    """A fixed 'model' for one request: logits per canvas position."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(gen, V, generator=g, dtype=torch.float32) * scale


@dataclass
class StepRecord:
    plan: StepPlan
    width: int
    rows: torch.Tensor  # per candidate: its row in `slots`
    positions: torch.Tensor  # per candidate: its canvas position
    tokens: torch.Tensor  # per candidate
    conf: torch.Tensor  # per candidate
    before: torch.Tensor  # [R, width] canvases before the commit
    after: torch.Tensor  # [R, width] canvases after the commit

    def newly(self, row: int = 0) -> list[int]:
        """Canvas positions of request row `row` that this step committed."""
        changed = self.before[row] != self.after[row]
        return changed.nonzero().flatten().tolist()


def _copy(h: torch.Tensor) -> torch.Tensor:
    return h.clone()


def run_step(batch: Batch, slots, logits_fn, *, max_rows: int = 1024) -> StepRecord:
    """One denoising step of the requests in `slots`, as StepEngine.step drives the
    rule, with `logits_fn(cand_slots, positions) -> [N, V]` in place of the model
    and LM head (the candidates' logits are the 'hidden' rows, projected by a copy)."""
    state, rule = batch.state, batch.rule
    slots = torch.as_tensor(slots, dtype=torch.long)
    rule.prepare(slots)
    width = int(state.gen_length[slots].max())
    plan = rule.plan(slots, width)
    rows, positions = plan.candidates.nonzero(as_tuple=True)
    cand_slots = slots[rows]
    hidden = logits_fn(cand_slots, positions)
    tokens, conf = chunked_reduce(
        hidden, torch.arange(len(rows)), cand_slots, positions, _copy, rule, max_rows
    )
    before = state.canvas[slots, :width].clone()
    grid_tokens = before.clone()
    grid_tokens[rows, positions] = tokens
    grid_conf = torch.full((len(slots), width), NEG_INF, dtype=conf.dtype)
    grid_conf[rows, positions] = conf
    rule.commit(slots, plan, grid_tokens, grid_conf)
    return StepRecord(plan, width, rows, positions, tokens, conf, before, state.canvas[slots, :width].clone())


def commit_values(batch: Batch, plan: StepPlan, tokens, conf) -> None:
    """Commit hand-chosen per-position tokens/confidences ([width] values) through
    the rule's commit, as the engine's grids carry them (read only at candidates)."""
    slots = batch.slots
    width = plan.candidates.shape[1]
    grid_tokens = batch.state.canvas[slots, :width].clone()
    grid_conf = torch.full((len(slots), width), NEG_INF)
    cand = plan.candidates
    grid_tokens[cand] = torch.as_tensor(tokens, dtype=torch.long).expand(len(slots), width)[cand]
    grid_conf[cand] = torch.as_tensor(conf, dtype=torch.float32).expand(len(slots), width)[cand]
    batch.rule.commit(slots, plan, grid_tokens, grid_conf)


def plan_for(batch: Batch, slots=None) -> StepPlan:
    slots = batch.slots if slots is None else torch.as_tensor(slots)
    batch.rule.prepare(slots)
    return batch.rule.plan(slots, int(batch.state.gen_length[slots].max()))


def reduce_rows(batch: Batch, logits: torch.Tensor, positions, slot: int = 0):
    """rule.reduce on rows of request `slot` at the given canvas positions."""
    positions = torch.as_tensor(positions, dtype=torch.long)
    batch.rule.prepare(batch.slots)
    slots = torch.full_like(positions, slot)
    return batch.rule.reduce(logits.clone(), slots, positions)


def expected_top(conf: torch.Tensor, candidates: list[int], count: int) -> list[int]:
    """The commit contract: the `count` highest confidences, ties toward the lower position."""
    ranked = sorted(candidates, key=lambda p: (-float(conf[p]), p))
    return sorted(ranked[:count])


def draws(seed, step, positions, stream, dtype, n=1) -> torch.Tensor:
    """Philox uniforms of the contract for one request: [len(positions), n]."""
    positions = torch.as_tensor(positions, dtype=torch.long)
    k = len(positions)
    return philox.uniform_rows(
        torch.full((k,), seed, dtype=torch.long), torch.full((k,), step, dtype=torch.long),
        positions, stream, n, dtype,
    )


def inverse_cdf_token(probs: torch.Tensor, u: float) -> int:
    """The contract: the smallest id whose float64 cumulative probability exceeds u * total."""
    cdf = torch.cumsum(probs.double(), 0)
    x = u * float(cdf[-1])
    return next(v for v in range(len(cdf)) if float(cdf[v]) > x)


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


# ---------------------------------------------------------------------------
# Dream
# ---------------------------------------------------------------------------


def spec_dream_count(num_masked: int, step: int, opts: DreamOptions) -> int:
    ts = torch.linspace(1, opts.eps, opts.steps + 1)
    if step == opts.steps - 1:
        return num_masked
    n = torch.tensor([num_masked]).sum() / 1  # int64 tensor / int -> float32, as the reference
    return int(n * (1 - ts[step + 1] / ts[step]))


def test_unmask_fractions_are_the_reference_float32_schedule():
    for steps, eps in ((16, 1e-3), (5, 0.25), (1, 1e-3)):
        ts = torch.linspace(1, eps, steps + 1)
        expected = [float(1 - ts[i + 1] / ts[i]) for i in range(steps)]
        got = unmask_fractions(steps, eps)
        assert got.dtype == torch.float32 and got.tolist() == expected


@pytest.mark.parametrize(
    "gen, alg",
    [(16, "maskgit_plus"), (256, "maskgit_plus"), (512, "maskgit_plus"),
     (16, "topk_margin"), (16, "entropy"), (64, "entropy")],
)
def test_dream_steps_equal_gen_truncation(gen, alg):
    opts = dream_opts(gen=gen, alg=alg)
    batch = single(opts)
    table = logits_table(gen, seed=gen)
    model = TableModel({0: table})
    committed = []
    for step in range(opts.steps):
        before = int(batch.masked(0).sum())
        if gen <= 64:
            rec = run_step(batch, batch.slots, model)
            assert len(rec.positions) == before  # a confidence alg needs every masked position
            n = len(rec.newly())
            assert rec.plan.count.tolist() == [n]
        else:  # the count does not depend on the confidences: skip the softmaxes
            plan = plan_for(batch)
            assert int(plan.candidates.sum()) == before
            commit_values(batch, plan, table.argmax(-1), table.max(-1).values)
            n = before - int(batch.masked(0).sum())
        assert n == spec_dream_count(before, step, opts), step
        committed.append(n)
    assert committed[0] == 0  # int() truncation: (1 - eps) < 1
    assert committed[-1] == 2  # MODEL_SPEC.md: 2 on the last step for these lengths
    assert sum(committed) == gen
    assert not batch.masked(0).any()
    assert batch.state.num_final(batch.slots, gen).tolist() == [gen]


def test_dream_confidence_alg_commits_most_confident():
    gen = 8
    table = logits_table(gen, seed=1)
    probs = torch.softmax(table, -1)
    for alg in ("maskgit_plus", "topk_margin", "entropy"):
        opts = dream_opts(gen=gen, steps=2, alg=alg)  # step 0 commits int(8*(1-s/t)) = 3
        batch = single(opts)
        rec = run_step(batch, batch.slots, TableModel({0: table}))
        assert rec.tokens.tolist() == table.argmax(-1).tolist()
        if alg == "maskgit_plus":
            expected = probs.max(-1).values
        elif alg == "topk_margin":
            top2 = probs.topk(2, -1).values
            expected = top2[:, 0] - top2[:, 1]
        else:
            expected = (probs * torch.log(probs + 1e-10)).sum(-1)
        assert torch.allclose(rec.conf, expected, rtol=1e-6, atol=1e-7)
        n = spec_dream_count(gen, 0, opts)
        assert n == 3 and rec.plan.count.tolist() == [3]
        assert rec.newly() == expected_top(expected, list(range(gen)), n)
        assert rec.newly() == sorted(torch.topk(expected, n).indices.tolist())
        run_step(batch, batch.slots, TableModel({0: table}))
        assert batch.canvas(0) == table.argmax(-1).tolist()


@pytest.mark.parametrize("gen, steps, eps", [(16, 16, 1e-3), (16, 4, 1e-3), (7, 3, 1e-3), (32, 1, 1e-3),
                                             (16, 2, 0.5)])  # last fraction 1/3: flips alone would not fill
def test_dream_origin_t0_fills_all_by_last_step(gen, steps, eps):
    for seed in range(3):
        batch = single(dream_opts(gen=gen, steps=steps, alg="origin", eps=eps), seed=seed)
        table = logits_table(gen, seed=seed)
        for step in range(steps):
            masked = batch.masked(0).nonzero().flatten().tolist()
            rec = run_step(batch, batch.slots, TableModel({0: table}))
            rows = rec.positions.tolist()
            assert set(rows) <= set(masked)
            if step == steps - 1:
                assert rows == masked
            # origin writes exactly the flipped positions, with their argmax at T=0.
            assert rec.newly() == rows
            assert rec.after[0, rows].tolist() == table[rows].argmax(-1).tolist()
        assert batch.canvas(0) == table.argmax(-1).tolist()


def test_dream_origin_flips_follow_contract():
    gen, steps, seed = 40, 4, 21
    ts = torch.linspace(1, 1e-3, steps + 1)
    batch = single(dream_opts(gen=gen, steps=steps, alg="origin"), seed=seed)
    table = logits_table(gen, seed=2)
    for step in range(2):
        masked = batch.masked(0)
        p = 1 - ts[step + 1] / ts[step]  # float32, as the reference
        u = draws(seed, step, range(gen), sampling.FLIP, torch.float32)[:, 0]
        expected = [pos for pos in range(gen) if masked[pos] and u[pos] < p]
        rec = run_step(batch, batch.slots, TableModel({0: table}))
        assert rec.positions.tolist() == expected
        assert rec.plan.count.tolist() == [len(expected)]
        assert 0 < len(expected) < int(masked.sum())  # p ~ 0.25, 0.33: not a vacuous draw


def test_filter_top_p_known_logits():
    logits = torch.tensor([[1.0, 3.0, 0.0, 2.0]])  # probs sorted ~ .644 .237 .087 .032
    lo = LOWEST32

    def top_p(x, p):
        return filter_top_p_top_k(x, torch.full((len(x),), p), torch.zeros(len(x), dtype=torch.long))

    assert top_p(logits, 0.5).tolist() == [[lo, 3.0, lo, lo]]  # keeps at least the top token
    assert top_p(logits, 1e-9).tolist() == [[lo, 3.0, lo, lo]]
    assert top_p(logits, 0.7).tolist() == [[lo, 3.0, lo, 2.0]]
    assert top_p(logits, 0.9).tolist() == [[1.0, 3.0, lo, 2.0]]
    assert top_p(logits, 0.999).tolist() == logits.tolist()
    assert top_p(logits, 1.0).tolist() == logits.tolist()  # 1: off
    # Rows are independent, with their own top_p.
    two = torch.tensor([[1.0, 3.0, 0.0, 2.0], [10.0, 0.0, 0.0, 0.0]])
    assert top_p(two, 0.7).tolist() == [[lo, 3.0, lo, 2.0], [10.0, lo, lo, lo]]
    out = filter_top_p_top_k(two, torch.tensor([0.7, 1.0]), torch.zeros(2, dtype=torch.long))
    assert out.tolist() == [[lo, 3.0, lo, 2.0], two[1].tolist()]  # one filtered, one not
    out = filter_top_p_top_k(two, torch.tensor([1.0, 0.7]), torch.zeros(2, dtype=torch.long))
    assert out.tolist() == [two[0].tolist(), [10.0, lo, lo, lo]]


def test_filter_top_k_known_logits():
    logits = torch.tensor([[1.0, 3.0, 0.0, 2.0], [5.0, 4.0, 3.0, 6.0]])
    lo = LOWEST32

    def top_k(x, k):
        return filter_top_p_top_k(x, torch.ones(len(x)), torch.full((len(x),), k))

    assert top_k(logits, 1).tolist() == [[lo, 3.0, lo, lo], [lo, lo, lo, 6.0]]
    assert top_k(logits, 2).tolist() == [[lo, 3.0, lo, 2.0], [5.0, lo, lo, 6.0]]
    assert top_k(logits, 4).tolist() == logits.tolist()
    assert top_k(logits, 100).tolist() == logits.tolist()  # k clipped to vocab
    assert top_k(logits, 0).tolist() == logits.tolist()  # 0: off
    # Per-row k in one batch: one row filtered, one not.
    out = filter_top_p_top_k(logits, torch.ones(2), torch.tensor([1, 0]))
    assert out.tolist() == [[lo, 3.0, lo, lo], logits[1].tolist()]
    out = filter_top_p_top_k(logits, torch.ones(2), torch.tensor([0, 2]))
    assert out.tolist() == [logits[0].tolist(), [5.0, lo, lo, 6.0]]
    # Ties at the k-th value are all kept (the reference removes only `< kth`).
    tied = torch.tensor([[2.0, 1.0, 2.0, 2.0]])
    assert top_k(tied, 1).tolist() == [[2.0, lo, 2.0, 2.0]]
    # k kept on random rows.
    x = torch.randn(20, 50, generator=torch.Generator().manual_seed(0))
    for k in (1, 3, 17):
        assert ((top_k(x, k) > lo).sum(-1) == k).all()


def test_filter_top_p_then_top_k_per_row():
    # top_p 0.9 keeps {3, 2, 1}; top_k 2 then keeps {3, 2}.  Row 2: top_k only.
    logits = torch.tensor([[1.0, 3.0, 0.0, 2.0], [1.0, 3.0, 0.0, 2.0], [1.0, 3.0, 0.0, 2.0]])
    lo = LOWEST32
    out = filter_top_p_top_k(logits, torch.tensor([0.9, 0.9, 1.0]), torch.tensor([2, 0, 3]))
    assert out.tolist() == [[lo, 3.0, lo, 2.0], [1.0, 3.0, lo, 2.0], [1.0, 3.0, lo, 2.0]]


def test_dream_top_k_renormalises_confidence_at_t0():
    row = torch.tensor([[4.0, 3.0, 1.0] + [0.0] * (V - 3)])
    batch = single(dream_opts(gen=1, top_k=2))
    tokens, conf = reduce_rows(batch, row, [0])
    assert int(tokens) == 0
    assert conf.item() == pytest.approx(math.exp(4) / (math.exp(4) + math.exp(3)), rel=1e-6)
    batch = single(dream_opts(gen=1, top_p=0.5))
    tokens, conf = reduce_rows(batch, row, [0])
    assert int(tokens) == 0 and conf.item() == pytest.approx(1.0)
    batch = single(dream_opts(gen=1))
    _, conf = reduce_rows(batch, row, [0])
    assert conf.item() == pytest.approx(float(torch.softmax(row[0], -1)[0]), rel=1e-6)
    # Unfiltered and filtered requests in one batch keep their own confidences.
    batch = admit([(dream_opts(gen=1), 0), (dream_opts(gen=1, top_k=2), 0)])
    batch.rule.prepare(batch.slots)
    _, conf = batch.rule.reduce(torch.cat([row, row]), batch.slots, torch.tensor([0, 0]))
    assert conf[0].item() == pytest.approx(float(torch.softmax(row[0], -1)[0]), rel=1e-6)
    assert conf[1].item() == pytest.approx(math.exp(4) / (math.exp(4) + math.exp(3)), rel=1e-6)


def test_dream_sampling_t_positive_follows_contract_and_is_chunk_invariant():
    gen, seed, T, top_p = 12, 4, 0.8, 0.95
    table = logits_table(gen, seed=2, scale=1.0)
    model = TableModel({0: table})
    records = []
    for max_rows in (1, 5, 1024):
        batch = single(dream_opts(gen=gen, T=T, top_p=top_p), seed=seed)
        records.append(run_step(batch, batch.slots, model, max_rows=max_rows))
    rec = records[0]
    u = draws(seed, 0, range(gen), sampling.SAMPLE, torch.float64)[:, 0]
    probs = torch.softmax(
        filter_top_p_top_k(table / T, torch.full((gen,), top_p), torch.zeros(gen, dtype=torch.long)), -1)
    for pos in range(gen):
        token = inverse_cdf_token(probs[pos], float(u[pos]))
        assert int(rec.tokens[pos]) == token
        assert rec.conf[pos].item() == pytest.approx(float(probs[pos, token]), rel=1e-6)
    assert rec.tokens.tolist() != table.argmax(-1).tolist()  # sampling did happen
    for other in records[1:]:
        assert torch.equal(other.tokens, rec.tokens) and torch.equal(other.conf, rec.conf)
        assert torch.equal(other.after, rec.after)
    batch = single(dream_opts(gen=gen, T=T, top_p=top_p), seed=seed)
    t, c = reduce_rows(batch, table[[7, 0]], [7, 0])
    assert t.tolist() == rec.tokens[[7, 0]].tolist() and torch.equal(c, rec.conf[[7, 0]])
    # top_k=1 at T > 0: the sample is the argmax.
    batch = single(dream_opts(gen=gen, T=1.5, top_k=1), seed=seed)
    t, c = reduce_rows(batch, table, range(gen))
    assert t.tolist() == table.argmax(-1).tolist() and torch.equal(c, torch.ones(gen))


def test_dream_alg_temp_selection_is_gumbel_top_k():
    """alg_temp picks `count` positions by the largest confidence / alg_temp + G,
    G = -log(-log u), u the float64 SELECT draw of (seed, step, canvas position)."""
    gen, steps, seed, alg_temp = 20, 4, 3, 0.5
    table = logits_table(gen, seed=8)
    opts = dream_opts(gen=gen, steps=steps, alg="entropy", alg_temp=alg_temp)
    runs, noise_mattered = [], False
    for _ in range(2):
        batch = single(opts, seed=seed)
        hist = []
        for step in range(steps):
            before = int(batch.masked(0).sum())
            rec = run_step(batch, batch.slots, TableModel({0: table}))
            n = spec_dream_count(before, step, opts)
            assert len(rec.newly()) == n == int(rec.plan.count[0])
            u = draws(seed, step, range(gen), sampling.SELECT, torch.float64)[:, 0]
            conf = torch.full((gen,), NEG_INF)
            conf[rec.positions] = rec.conf
            keys = (conf / alg_temp).double() - torch.log(-torch.log(u))
            assert rec.newly() == expected_top(keys, rec.positions.tolist(), n)
            noise_mattered |= rec.newly() != expected_top(conf, rec.positions.tolist(), n)
            hist.append(rec.after.clone())
        assert not batch.masked(0).any()
        runs.append(hist)
    assert noise_mattered  # plain confidence ranking would have picked otherwise
    assert all(torch.equal(a, b) for a, b in zip(*runs))  # deterministic given the seed
    other = single(opts, seed=seed + 1)
    run_step(other, other.slots, TableModel({0: table}))
    rec = run_step(other, other.slots, TableModel({0: table}))
    assert not torch.equal(rec.after, runs[0][1])  # the seed matters


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
    plan = StepPlan(candidates=plan.candidates & torch.tensor([True, True, False, True, True, True]),
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
