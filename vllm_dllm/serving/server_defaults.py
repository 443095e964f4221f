"""Server-wide decoding settings: the model's generation_config.json and the server's
`--additional-config '{"dllm": {...}}'` over the papers' defaults, validated once at
start-up and shared (as a dict) by every process of one engine; requests resolve
against them (options.resolve).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from vllm_dllm.options import (
    DREAM,
    DREAM_FILTER_KEYS,
    KINDS,
    PAPER_DEFAULTS,
    SERVER,
    OptionError,
    check_cache_knobs,
    check_overrides,
    defaults_from_generation_config,
)

ADMISSION_MODES = ("greedy", "lookahead", "reserve", "static")
ATTENTION_BACKENDS = ("torch", "triton", "flash")  # see attention/backends.py
DEFAULT_MAX_NUM_LOGITS = 1024
# Denoising steps one engine call may run (scheduler/track.py steps_in_call): fewer
# host round trips per token; a request arriving meanwhile waits at most one call.
DEFAULT_MAX_STEPS_PER_CALL = 8


@dataclass(frozen=True)
class ServerDefaults:
    """Resolved server-wide settings, shared by every process of one engine."""

    kind: str
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    max_num_logits: int = DEFAULT_MAX_NUM_LOGITS
    admission: str = "greedy"  # see scheduler/plan.py: greedy, lookahead, reserve, static
    max_steps_per_call: int = DEFAULT_MAX_STEPS_PER_CALL
    attention_backend: str | None = None  # None: chosen by device
    # JSON grammars allow whitespace between tokens (vLLM's default); else compact JSON.
    any_whitespace: bool = False
    # Why this deployment refuses the sparse KV cache (server_config.py), if it does.
    sparse_refusal: str | None = None

    @classmethod
    def build(
        cls, kind: str, generation_config: dict[str, Any], server: dict[str, Any]
    ) -> "ServerDefaults":
        if not isinstance(server, dict):
            raise OptionError(f"{SERVER}'dllm' must be a JSON object, got {type(server).__name__}")
        server = dict(server)
        max_num_logits = server.pop("max_num_logits", DEFAULT_MAX_NUM_LOGITS)
        if type(max_num_logits) is not int or max_num_logits < 2:
            # Classifier-free guidance projects a conditional and an unconditional
            # row per position in one chunk.
            raise OptionError(f"{SERVER}'max_num_logits' must be an integer of at least 2, got {max_num_logits!r}")
        admission = server.pop("admission", "greedy")
        if admission not in ADMISSION_MODES:
            raise OptionError(
                f"{SERVER}'admission' must be one of {', '.join(ADMISSION_MODES)}, got {admission!r}"
            )
        max_steps_per_call = server.pop("max_steps_per_call", DEFAULT_MAX_STEPS_PER_CALL)
        if type(max_steps_per_call) is not int or max_steps_per_call < 1:
            raise OptionError(
                f"{SERVER}'max_steps_per_call' must be an integer of at least 1, got {max_steps_per_call!r}"
            )
        attention_backend = server.pop("attention_backend", None)
        if attention_backend is not None and attention_backend not in ATTENTION_BACKENDS:
            raise OptionError(
                f"{SERVER}'attention_backend' must be one of "
                f"{', '.join(ATTENTION_BACKENDS)}, got {attention_backend!r}"
            )
        any_whitespace = server.pop("any_whitespace", False)
        if type(any_whitespace) is not bool:
            raise OptionError(f"{SERVER}'any_whitespace' must be true or false, got {any_whitespace!r}")
        for key in DREAM_FILTER_KEYS:
            if kind == DREAM and key in server:
                # One source of server-wide sampling defaults: vLLM's, which it also
                # applies itself at temperature > 0.
                raise OptionError(
                    f"{SERVER}'{key}' is a standard sampling parameter: set its server-wide default "
                    f"with vLLM's --override-generation-config '{{\"{key}\": ...}}'"
                )
        expand = KINDS[kind].expand
        merged = dict(PAPER_DEFAULTS[kind])
        merged.update(expand(defaults_from_generation_config(kind, generation_config)))
        server = check_overrides(kind, server, SERVER)
        check_cache_knobs({**merged, **server}, server, SERVER)
        merged.update(expand(server))
        return cls(
            kind=kind,
            overrides=merged,
            max_num_logits=max_num_logits,
            admission=admission,
            max_steps_per_call=max_steps_per_call,
            attention_backend=attention_backend,
            any_whitespace=any_whitespace,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "overrides": dict(self.overrides),
            "max_num_logits": self.max_num_logits,
            "admission": self.admission,
            "max_steps_per_call": self.max_steps_per_call,
            "attention_backend": self.attention_backend,
            "sparse_refusal": self.sparse_refusal,
            "any_whitespace": self.any_whitespace,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ServerDefaults":
        return cls(
            kind=data["kind"],
            overrides=dict(data["overrides"]),
            max_num_logits=int(data["max_num_logits"]),
            admission=data.get("admission", "greedy"),
            max_steps_per_call=int(data.get("max_steps_per_call", DEFAULT_MAX_STEPS_PER_CALL)),
            attention_backend=data.get("attention_backend"),
            sparse_refusal=data.get("sparse_refusal"),
            any_whitespace=data.get("any_whitespace", False),
        )

    def deployment_problem(self, options) -> str | None:
        """Why this server cannot run a request's resolved options, if it cannot."""
        if self.sparse_refusal and getattr(options, "cache", None) == "sparse":
            return self.sparse_refusal
        return None
