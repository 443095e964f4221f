"""Diffusion metrics: per-step counts from the engine, Prometheus counters in the server.

The engine core sends per-step scheduler stats to the front end in vLLM's own
`SpecDecodingStats`, as vLLM does for its in-tree diffusion model: one "draft" per
request-step is one denoising step, draft tokens are canvas positions, accepted
tokens are committed (final) tokens.  With no speculative config vLLM's own
Prometheus logger ignores these; ours, a `vllm.stat_logger_plugins` entry point,
exposes them under the names `vllm bench serve` reads (vllm:diffusion_*), plus our
own.  Our extra per-step numbers travel in `num_draft_tokens_per_pos`, which nothing
else reads without a speculative config, in the fixed layout of `EXTRA_FIELDS`.
"""

from __future__ import annotations

from dataclasses import dataclass

import prometheus_client
from vllm.v1.metrics.loggers import StatLoggerBase
from vllm.v1.spec_decode.metrics import SpecDecodingStats

EXTRA_FIELDS = ("refresh_steps", "reuse_steps", "query_tokens", "logits_rows", "delayed_steps", "cache_rebuilds",
                "kv_slots", "kv_dense_slots", "edited_tokens", "completed_blocks", "returned_tokens",
                "forced_tokens")


@dataclass
class StepStats:
    denoising_steps: int = 0
    canvas_positions: int = 0
    committed_tokens: int = 0
    refresh_steps: int = 0
    reuse_steps: int = 0
    query_tokens: int = 0
    logits_rows: int = 0
    delayed_steps: int = 0  # running requests that sat a step out for lack of budget
    cache_rebuilds: int = 0  # steps that first rebuilt a cache preemption freed (phases.py)
    kv_slots: int = 0  # KV slots the running requests hold (kv_footprint.py)...
    kv_dense_slots: int = 0  # ...and would hold with every position cached
    edited_tokens: int = 0  # committed tokens rewritten by token editing (LLaDA2.1)
    completed_blocks: int = 0  # canvas blocks that ended (denoising steps / blocks: forwards per block)
    returned_tokens: int = 0  # final tokens a grammar rejected, returned to the mask (structured outputs)
    forced_tokens: int = 0  # tokens a grammar forced at a frontier, committed without a step (jump-forward)

    def to_spec_decoding_stats(self) -> SpecDecodingStats:
        return SpecDecodingStats(
            num_spec_tokens=0,
            num_drafts=self.denoising_steps,
            num_draft_tokens=self.canvas_positions,
            num_accepted_tokens=self.committed_tokens,
            num_accepted_tokens_per_pos=[],
            num_draft_tokens_per_pos=[getattr(self, name) for name in EXTRA_FIELDS],
        )

    @classmethod
    def from_spec_decoding_stats(cls, stats: SpecDecodingStats) -> "StepStats":
        extras = dict(zip(EXTRA_FIELDS, stats.num_draft_tokens_per_pos))
        return cls(
            denoising_steps=stats.num_drafts,
            canvas_positions=stats.num_draft_tokens,
            committed_tokens=stats.num_accepted_tokens,
            **extras,
        )


_COUNTERS = {
    "denoising_steps": ("vllm:diffusion_num_denoising_steps", "Number of denoising steps (one per request per step)."),
    "canvas_positions": ("vllm:diffusion_num_canvas_positions", "Canvas positions processed by denoising steps."),
    "committed_tokens": ("vllm:diffusion_num_committed_tokens", "Tokens committed (final) by denoising steps."),
    "refresh_steps": ("vllm:diffusion_num_refresh_steps", "Denoising steps that recomputed the whole sequence."),
    "reuse_steps": ("vllm:diffusion_num_reuse_steps", "Denoising steps that reused cached K/V."),
    "delayed_steps": (
        "vllm:diffusion_num_delayed_steps",
        "Steps a running request sat out because its step did not fit the token budget.",
    ),
    "cache_rebuilds": (
        "vllm:diffusion_num_cache_rebuilds",
        "Denoising steps that first rebuilt a KV cache freed by preemption.",
    ),
    "edited_tokens": (
        "vllm:diffusion_num_edited_tokens",
        "Committed tokens rewritten by token editing (LLaDA2.1).",
    ),
    "completed_blocks": (
        "vllm:diffusion_num_completed_blocks",
        "Canvas blocks that ended; denoising steps per completed block is the forwards per block.",
    ),
    "returned_tokens": (
        "vllm:diffusion_num_grammar_returned_tokens",
        "Final tokens a structured-output grammar rejected, returned to the mask and decoded again.",
    ),
    "forced_tokens": (
        "vllm:diffusion_num_grammar_forced_tokens",
        "Tokens a structured-output grammar allowed alone, committed without a denoising step (jump-forward).",
    ),
}
_GAUGES = {
    "kv_slots": ("vllm:diffusion_kv_slots", "KV slots held by the running requests (sparse: kept positions + block)."),
    "kv_dense_slots": (
        "vllm:diffusion_kv_dense_slots",
        "KV slots the running requests would hold with every position cached.",
    ),
}
_BUCKETS = (1, 8, 32, 128, 512, 1024, 2048, 4096, 8192, 16384, 32768)

# An info series, as vLLM's vllm:cache_config_info: value 1, the facts in its labels.
# Clients read it to decode as the server does by default (lab.eval's
# ServerRunner: a block-diffusion model is asked for at least one block).
DECODING_INFO = "vllm:diffusion_decoding_info"


def decoding_info(vllm_config) -> dict[str, str]:
    """The served model's kind and default blocks, as label values."""
    from vllm_dllm.serving.server_config import BLOCK_CAUSAL_KINDS, server_defaults

    defaults = server_defaults(vllm_config)
    block_length = defaults.overrides.get("block_length")
    return {
        "kind": defaults.kind,
        "block_causal": str(defaults.kind in BLOCK_CAUSAL_KINDS).lower(),
        "block_length": "" if block_length is None else str(block_length),
    }


class DiffusionStatLogger(StatLoggerBase):
    """Registered as a stat-logger plugin; active only when a diffusion model is served."""

    def __init__(self, vllm_config, engine_index: int = 0):
        from vllm_dllm.serving.server_config import served_kind

        self.active = vllm_config.model_config is not None and served_kind(vllm_config.model_config) is not None
        self.labels = {
            "model_name": vllm_config.model_config.served_model_name if self.active else "",
            "engine": str(engine_index),
        }
        self.info = decoding_info(vllm_config) if self.active else {}
        self.counters = None

    def _register(self) -> None:
        # Not in __init__: vLLM's own Prometheus logger, built after the plugins,
        # unregisters every "vllm:" collector that exists when it starts.
        labels = self.labels
        names = list(labels)
        self.counters = {
            key: _metric(prometheus_client.Counter, name, doc, names).labels(**labels)
            for key, (name, doc) in _COUNTERS.items()
        }
        self.gauges = {
            key: _metric(prometheus_client.Gauge, name, doc, names).labels(**labels)
            for key, (name, doc) in _GAUGES.items()
        }
        self.query_tokens = _metric(
            prometheus_client.Histogram,
            "vllm:diffusion_scheduled_query_tokens_per_step",
            "Query tokens one engine step (a call of denoising steps) ran.",
            names,
            buckets=_BUCKETS,
        ).labels(**labels)
        self.logits_rows = _metric(
            prometheus_client.Histogram,
            "vllm:diffusion_logits_rows_per_step",
            "LM-head rows one engine step computed (masked positions only).",
            names,
            buckets=_BUCKETS,
        ).labels(**labels)
        info = {**labels, **self.info}
        _metric(prometheus_client.Gauge, DECODING_INFO, "The served model's kind and default decoding blocks.",
                list(info)).labels(**info).set(1)

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
        if not self.active or scheduler_stats is None:
            return
        if self.counters is None:
            self._register()
        if scheduler_stats.spec_decoding_stats is None:
            # No step ran (e.g. the engine's step that only clears finished or aborted
            # requests): the gauges fall back to 0 once nothing runs.
            if not scheduler_stats.num_running_reqs:
                for gauge in self.gauges.values():
                    gauge.set(0)
            return
        step = StepStats.from_spec_decoding_stats(scheduler_stats.spec_decoding_stats)
        for key, counter in self.counters.items():
            value = getattr(step, key)
            if value:
                counter.inc(value)
        for key, gauge in self.gauges.items():  # held after the step (scheduler.make_stats)
            gauge.set(getattr(step, key))
        if step.query_tokens:  # a step ran (prefill chunks count, denoising nothing)
            self.query_tokens.observe(step.query_tokens)
            self.logits_rows.observe(step.logits_rows)

    def log_engine_initialized(self):
        # Called once every logger exists: the series show from the first scrape.
        if self.active and self.counters is None:
            self._register()


def _metric(cls, name: str, doc: str, labelnames: list[str], **kwargs):
    """Create the metric, or reuse it when this process already registered it
    (a second engine in the same process, e.g. tests)."""
    registry = prometheus_client.REGISTRY
    existing = registry._names_to_collectors.get(name) or registry._names_to_collectors.get(name + "_total")
    if existing is not None:
        return existing
    return cls(name, doc, labelnames=labelnames, **kwargs)
