"""The record types of the vLLM surface list, the release ranges an expectation can
name, and the vLLM module paths the lists share.

The lists themselves are in names.py, overrides.py, calls.py and reviewed.py (the
package docstring says what each kind of record means).
"""

from __future__ import annotations

from dataclasses import dataclass, field

Versions = tuple[tuple[int, int], tuple[int, int]]
EVERY = ((0, 0), (99, 0))
# compat.V1_RUNNERS_REMOVED: vLLM's V1 runners, the V1/V2 switch and the V1
# logits-processor interface exist before 0.34; the V2 interface from 0.34 on.
BEFORE_034: Versions = ((0, 0), (0, 34))
FROM_034: Versions = ((0, 34), (99, 0))


def applies(item, version: tuple[int, int]) -> bool:
    low, high = getattr(item, "versions", EVERY)
    return low <= version < high


@dataclass(frozen=True)
class Name:
    module: str
    name: str
    why: str = ""
    versions: Versions = EVERY


@dataclass(frozen=True)
class Override:
    module: str
    qualname: str  # "Class.method"
    signature: str  # as printed by vllm_surface_check.signature_text
    why: str = ""
    versions: Versions = EVERY


@dataclass(frozen=True)
class Call:
    module: str
    qualname: str  # "function" or "Class.__init__" / "Class.method"
    positional: int  # positional arguments we pass (self/cls not counted)
    keywords: tuple[str, ...] = ()
    why: str = ""
    versions: Versions = EVERY


@dataclass(frozen=True)
class Members:
    module: str
    cls: str
    names: tuple[str, ...]
    why: str = ""
    versions: Versions = EVERY


@dataclass(frozen=True)
class Constructed:
    module: str
    cls: str
    fields: tuple[str, ...]
    why: str = ""
    versions: Versions = EVERY


@dataclass(frozen=True)
class Literal:
    module: str
    value: str
    why: str = ""
    versions: Versions = EVERY


@dataclass(frozen=True)
class Reviewed:
    module: str
    qualname: str
    fingerprints: dict[str, str]  # vLLM version -> code fingerprint reviewed
    note: str
    versions: Versions = EVERY


@dataclass(frozen=True)
class RunnerCalls:
    modules: tuple[str, ...]
    provided: frozenset[str]
    not_needed: dict[str, str] = field(default_factory=dict)


SCHED = "vllm.v1.core.sched.scheduler"
OUTPUT = "vllm.v1.core.sched.output"
KV = "vllm.v1.kv_cache_interface"
LAYERS = "vllm.model_executor.layers"
