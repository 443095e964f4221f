"""Counting the torch ops one engine step dispatches (tests and benchmarks/step_bench.py)."""

from __future__ import annotations

from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode

# Ops whose output size or value is data: on a GPU each makes the host wait.  (The
# engine keeps its host bookkeeping in numpy, so what is counted here is device data.
# A device-to-host copy of a CPU tensor dispatches nothing: on a CPU the step's final
# copy is not counted.)
SYNC_OPS = frozenset(
    {"nonzero", "nonzero_numpy", "nonzero_static", "_local_scalar_dense", "masked_select", "unique", "_unique2",
     "item", "equal"}
)


class OpCounter(TorchDispatchMode):
    """Counts dispatched ops that do work.  Views are skipped: they launch nothing,
    and SDPA's internal reshaping of a batch of one differs by a few views."""

    def __init__(self):
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    @property
    def syncs(self) -> int:
        return sum(n for op, n in self.ops.items() if op in SYNC_OPS)
