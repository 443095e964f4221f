"""What a sparse KV cache request gets unless it sets `scoring` or `pool_kernel`: each
selection's own, as measured on the shipped model (benchmarks/results/)."""

from __future__ import annotations

# Attention weights help head-centric selection (sparse-quality-weight); uniform keeps
# Sparse-dLLM's largest logit.
SCORINGS = {"head": "weight", "uniform": "max"}

# Pooling helps uniform selection (Sparse-dLLM's window of 3).  Head-centric selection
# pools from this retention on: pooling widens each of a head's peaks to three positions,
# so a small budget pooled keeps a third as many peaks (addition at r=0.3 falls 7
# points), while a budget of 40% of the context or more has room for the neighbours of
# what a head reads, which a reversed copy reads next (sparse-pool-retention).
HEAD_POOLING_RETENTION = 0.4


def default_pool_kernel(selection: str, retention: float) -> int:
    """The max-pooling window of a sparse request that sets none."""
    return 3 if selection == "uniform" or retention >= HEAD_POOLING_RETENTION else 1
