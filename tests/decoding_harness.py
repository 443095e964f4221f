"""Shared helpers of the batched decoding-rule tests (test_llada_rule.py,
test_dream_rule.py, test_batched_decoding.py).

Designed logits over a tiny vocabulary, no model and no engine.  The mask id lies
outside the vocabulary so a candidate token can never be mistaken for a mask.

`run_step` reproduces the engine's per-step data flow (StepEngine.step) with a
"model" that is a table of logits per (request, canvas position): prepare -> plan ->
the candidates' logits through chunked_reduce (which calls rule.reduce per chunk)
-> tokens/confidences scattered into [R, width] grids -> commit.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from vllm_dllm.decoding.base import DecodeState, SpecialIds, CandidatePlan
from vllm_dllm.decoding.rules import make_rule
from vllm_dllm.decoding.dream import DreamRule
from vllm_dllm.decoding.llada import LLaDARule
from vllm_dllm.decoding.logits import chunked_reduce
from vllm_dllm.decoding import philox
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
        """Admitted slots whose last block has not ended (what a scheduler would run)."""
        s = self.state
        return self.slots[s.block[self.slots] < s.num_blocks[self.slots]]


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
    plan: CandidatePlan
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
    width = int(state.gen_length[slots].max())
    before = state.canvas[slots, :width].clone()

    def reduce(rows, positions):
        cand_slots = slots[rows]
        hidden = logits_fn(cand_slots, positions)
        return chunked_reduce(hidden, torch.arange(len(rows)), cand_slots, positions, _copy, rule, max_rows)

    d = rule.denoise(slots, slots, width, reduce)
    return StepRecord(d.plan, width, d.rows, d.positions, d.tokens, d.confidence, before,
                      state.canvas[slots, :width].clone())


def commit_values(batch: Batch, plan: CandidatePlan, tokens, conf) -> None:
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


def plan_for(batch: Batch, slots=None) -> CandidatePlan:
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


