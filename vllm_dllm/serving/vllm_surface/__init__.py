"""Every vLLM name the plugin relies on, for `python -m vllm_dllm.tools.vllm_surface_check`.

Pure data (no vLLM import): a release is judged by reading its source against this
list.  Derived from every `vllm` import and use in vllm_dllm/ and the entry-point
groups in pyproject.toml; tests/unit/test_vllm_surface.py fails when plugin code imports
a vLLM name that is not listed in NAMES, or when a listed import is no longer used.

Kinds of expectation:
- NAMES: `from module import name` must still find the name (re-exports and vLLM's
  lazy `__getattr__` maps followed).
- OVERRIDES: methods we override, or that vLLM calls on our duck-typed objects with
  its own signature: parameter names, kinds and defaults must be exactly these.
- CALLS: functions and constructors we call: our arguments must still bind (new
  optional parameters are fine, a new required one or a renamed keyword is not).
- MEMBERS: attributes, methods and enum members we read or set on vLLM objects.
- CONSTRUCTED: dataclass-like classes we build with these fields: the fields must
  exist and no field without a default may be added.
- LITERALS: strings vLLM must still read where it did (entry-point groups, env vars).
- REVIEWED: functions whose *behaviour* our code depends on, with the code
  fingerprints of the versions we reviewed and how we handle each.  A new
  fingerprint is not a failure of the surface but a "look here" for a new release.
- RUNNER_CALLS: what vLLM's workers call on `self.model_runner` (our runner is not a
  vLLM class): each name is either provided by DiffusionModelRunner or known to be on
  a path our workers never take.

An expectation that holds only on some releases (compat.py branches on them) names
them in `versions`, a [low, high) range of (major, minor); a release outside it is
not checked against it.

The package, one job a module (read the lists from here: `vllm_surface.NAMES`):
  records.py    the record types, the release ranges (EVERY, BEFORE_034, FROM_034,
                applies) and the vLLM module paths the lists share;
  names.py      NAMES;
  overrides.py  OVERRIDES;
  calls.py      CALLS, MEMBERS, CONSTRUCTED and LITERALS;
  reviewed.py   REVIEWED and RUNNER_CALLS.
The list modules import records.py, never this package.
"""

from vllm_dllm.serving.vllm_surface.calls import CALLS, CONSTRUCTED, LITERALS, MEMBERS
from vllm_dllm.serving.vllm_surface.names import NAMES
from vllm_dllm.serving.vllm_surface.overrides import OVERRIDES
from vllm_dllm.serving.vllm_surface.records import (
    BEFORE_034,
    EVERY,
    FROM_034,
    KV,
    LAYERS,
    OUTPUT,
    SCHED,
    Call,
    Constructed,
    Literal,
    Members,
    Name,
    Override,
    Reviewed,
    RunnerCalls,
    Versions,
    applies,
)
from vllm_dllm.serving.vllm_surface.reviewed import REVIEWED, RUNNER_CALLS

__all__ = [
    # The records and release ranges.
    "BEFORE_034",
    "EVERY",
    "FROM_034",
    "Call",
    "Constructed",
    "Literal",
    "Members",
    "Name",
    "Override",
    "Reviewed",
    "RunnerCalls",
    "Versions",
    "applies",
    # The vLLM module paths the lists share.
    "KV",
    "LAYERS",
    "OUTPUT",
    "SCHED",
    # The lists.
    "NAMES",
    "OVERRIDES",
    "CALLS",
    "MEMBERS",
    "CONSTRUCTED",
    "LITERALS",
    "REVIEWED",
    "RUNNER_CALLS",
]
