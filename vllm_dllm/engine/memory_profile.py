"""The dummy step vLLM's memory profiling runs: the largest step the caps allow, so
the KV pool is sized around its peak.  Imports no vLLM."""

from __future__ import annotations

import numpy as np
import torch

from vllm_dllm.attention.metadata import attention_metadata
from vllm_dllm.engine.step_inputs import SequenceLayout, build_step_inputs


@torch.inference_mode()
def peak_step(engine, max_num_tokens: int) -> None:
    """Full-length Refresh sequences filling the token budget through `engine`'s
    model, then the LM head and the costliest reduction over `max_num_logits` rows."""
    lengths = []
    remaining = max_num_tokens
    while remaining > 0:
        lengths.append(min(remaining, engine.max_model_len))
        remaining -= lengths[-1]
    count = len(lengths)
    seq_len = np.array(lengths, dtype=np.int64)
    zeros = np.zeros(count, dtype=np.int64)
    layout = SequenceLayout(
        slot=zeros, twin=zeros.astype(bool), query_start=zeros, num_queries=seq_len, seq_len=seq_len, kv_start=zeros
    )
    inputs = build_step_inputs(
        layout,
        prompt_tokens=engine.prompt_tokens,
        prompt_len=engine.prompt_len,
        canvas=engine.decode.canvas,
        block_table=torch.zeros_like(engine.block_table),
        block_size=engine.block_size,
        mask_id=engine.ids.mask,
        backend=engine.backend,
    )
    with attention_metadata(inputs.metadata), engine.model_context(len(inputs.input_ids)):
        hidden = engine.model(torch.zeros_like(inputs.input_ids), inputs.positions)
    rows = min(engine.max_num_logits, len(hidden))
    logits = engine.lm_head.project(hidden[:rows])
    # The costliest reduction: a float64 softmax and cumulative sum over every row.
    cdf = torch.cumsum(torch.softmax(logits.double(), dim=-1), dim=-1)
    del cdf, logits, hidden
