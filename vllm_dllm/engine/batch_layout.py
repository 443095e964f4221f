"""The sequences of one step: each scheduled request, its CFG twin, and the
cache-filling sequences (sparse Refreshes, rebuilds of evicted caches), with each
request's phase.  Pure host arithmetic over the batch's per-slot arrays (numpy)."""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from vllm_dllm.engine.batch_phases import POLICY_SPARSE, PhaseParams, batch_phases
from vllm_dllm.engine.step_inputs import FillLayout, SequenceLayout
from vllm_dllm.kv_footprint import kept_positions, sequence_slots


@dataclass
class BatchLayout:
    # The scheduled requests in order, then their CFG twins; cache fills last.
    sequences: SequenceLayout
    fill: FillLayout | None  # the cache-filling sequences, if any
    refresh: np.ndarray  # bool per request: this step is a Refresh
    rebuild: np.ndarray  # bool per request: its evicted cache is rebuilt before its Reuse
    decodes: np.ndarray  # bool per request: False for a block-causal prefill chunk (K/V only)
    query_end: np.ndarray  # per request: one past its last query position
    tokens: np.ndarray  # query tokens per request (both copies under CFG)
    request_seq: np.ndarray  # sequence index of each request
    twin_seq: np.ndarray  # sequence index of each request's twin (its own without CFG)
    has_twins: bool  # some request runs a CFG twin


@dataclass
class SparseParams:
    """Per-slot sparse KV numbers (host): see kv_footprint.py and attention/sparse.py."""

    sequence_slots: np.ndarray  # KV slots of one sequence (dense: its length)
    keep: np.ndarray  # positions each KV head keeps (0 unless sparse)
    radius: np.ndarray
    uniform: np.ndarray
    mean_scoring: np.ndarray
    weight_scoring: np.ndarray

    def admit(self, slot: int, options, prompt_len: int) -> None:
        self.sequence_slots[slot] = sequence_slots(options, prompt_len)
        self.keep[slot] = kept_positions(options, prompt_len)
        self.radius[slot] = options.pool_kernel // 2
        self.uniform[slot] = options.selection == "uniform"
        self.mean_scoring[slot] = options.scoring == "mean"
        self.weight_scoring[slot] = options.scoring == "weight"


def same_layout(a: BatchLayout, b: BatchLayout) -> bool:
    """Whether two steps pack the same sequences the same way (no cache fills,
    no rebuilds): one step's inputs serve the other over the canvas as it is then."""
    if a.fill is not None or b.fill is not None or a.rebuild.any() or b.rebuild.any():
        return False
    if a.has_twins != b.has_twins or not np.array_equal(a.request_seq, b.request_seq) \
            or not np.array_equal(a.twin_seq, b.twin_seq):
        return False
    return all(
        (x is None and y is None) or (x is not None and y is not None and np.array_equal(x, y))
        for x, y in ((getattr(a.sequences, f.name), getattr(b.sequences, f.name)) for f in fields(a.sequences))
    )


def batch_layout(
    host: PhaseParams, sparse: SparseParams, evicted: np.ndarray, copies: np.ndarray, slots: np.ndarray,
) -> BatchLayout:
    """The step's sequences for the requests in `slots`: the requests, their CFG
    twins (`copies` 2), then the cache fills last; `evicted`: slots whose cache
    preemption freed (rebuilt within the step before a Reuse)."""

    h, sp = host, sparse
    params = {name: getattr(h, name)[slots] for name in PhaseParams.__dataclass_fields__}
    evicted = evicted[slots]
    params["has_cache"] = params["has_cache"] | evicted  # rebuilt within the step
    phases = batch_phases(PhaseParams(**params))
    rebuilds = evicted & ~phases.refresh
    copies = copies[slots]
    requests = len(slots)
    twins = np.flatnonzero(copies == 2)
    rebuilt = np.flatnonzero(rebuilds)
    rebuilt = np.concatenate([rebuilt, rebuilt[copies[rebuilt] == 2]])
    own = requests + len(twins)
    request_of = np.concatenate([np.arange(requests), twins, rebuilt])  # per sequence
    twin = np.zeros(len(request_of), dtype=bool)
    twin[requests:own] = True
    twin[own + int(rebuilds.sum()):] = True
    rebuild = np.arange(len(request_of)) >= own
    is_sparse = h.policy[slots] == POLICY_SPARSE
    fills = rebuild | (phases.refresh & is_sparse)[request_of]
    order = np.argsort(fills, kind="stable")  # cache fills last
    request_of, twin, rebuild, fills = request_of[order], twin[order], rebuild[order], fills[order]
    position = np.empty_like(order)
    position[order] = np.arange(len(order))
    request_seq = position[:requests]
    twin_seq = request_seq.copy()
    twin_seq[twins] = position[requests:own]

    seq_len = h.prompt_len[slots] + h.gen_length[slots]
    keep = sp.keep[slots]
    sparse_reuse = is_sparse & ~phases.refresh
    r = request_of
    layout = SequenceLayout(
        slot=slots[r],
        twin=twin,
        query_start=np.where(rebuild, 0, phases.query_start[r]),
        num_queries=np.where(rebuild, seq_len[r], phases.num_queries[r]),
        seq_len=np.where(rebuild, seq_len[r], np.where(sparse_reuse, keep + phases.num_queries, seq_len)[r]),
        kv_start=np.where(twin, sp.sequence_slots[slots][r], 0),
        slot_start=np.where(rebuild, 0, np.where(sparse_reuse, keep, phases.query_start)[r]),
        rebuild=rebuild,
    )
    fill = None
    if fills.any():
        f = r[fills]
        span = phases.reuse_end[f] - phases.reuse_start[f]
        fill = FillLayout(
            reuse_start=phases.reuse_start[f], reuse_end=phases.reuse_end[f],
            keep=np.where(is_sparse[f], keep[f], seq_len[f] - span),
            radius=sp.radius[slots][f], uniform=sp.uniform[slots][f],
            mean_scoring=sp.mean_scoring[slots][f], weight_scoring=sp.weight_scoring[slots][f], dense=~is_sparse[f],
        )
    tokens = (phases.num_queries + rebuilds * seq_len) * copies
    layout, last_piece = layout.split_blocks(phases.segment[r] * ~twin)
    request_seq, twin_seq = last_piece[request_seq], last_piece[twin_seq]
    return BatchLayout(layout, fill, phases.refresh, rebuilds, phases.decodes, phases.query_end, tokens,
                       request_seq, twin_seq, len(twins) > 0)
