"""Run the plugin's LLaDA-MoE model (vLLM's layers and fused MoE with the release's
routing, our paged attention) on bidirectional query ranges and print its logits as
JSON.

A script, run in a child process by tests/engine/test_llada_moe_model.py, for the reason
tests/llada2_model_run.py gives (it builds the model the same way).

    python tests/llada_moe_model_run.py MODEL_DIR TOKENS_JSON RANGES_JSON

RANGES_JSON: a list of forwards, each [start, end]: the queries of positions
[start, end) attend over the whole sequence, their own K/V fresh and the others' from
the pool (written by earlier forwards), as a LLaDA Refresh (the whole range) and a
Reuse (a block of it) do.  Prints, per forward, the logits of its query rows.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch

from tests.llada2_model_run import build_model


def main(model_dir: str, tokens: list[int], ranges: list[list[int]]) -> list:
    from vllm.forward_context import set_forward_context

    from vllm_dllm.attention.backends import TorchAttention
    from vllm_dllm.attention.metadata import attention_metadata
    from vllm_dllm.engine.step_inputs import SequenceLayout, build_step_inputs

    model, vllm_config = build_model(model_dir)
    page = 16
    num_pages = -(-len(tokens) // page) + 1
    for layer in model.model.attention_layers():
        layer.bind_kv_cache(torch.zeros(num_pages, page, 2, layer.num_kv_heads, layer.head_dim))
    block_table = torch.arange(num_pages, dtype=torch.int32)[None, :]
    prompt = torch.tensor([tokens])
    zero = np.zeros(1, dtype=np.int64)
    out = []
    for start, end in ranges:
        layout = SequenceLayout(slot=zero, twin=zero.astype(bool), query_start=np.array([start]),
                                num_queries=np.array([end - start]), seq_len=np.array([len(tokens)]), kv_start=zero)
        inputs = build_step_inputs(
            layout, prompt_tokens=prompt, prompt_len=torch.tensor([len(tokens)]),
            canvas=torch.zeros(1, 1, dtype=torch.long), block_table=block_table, block_size=page, mask_id=0,
            backend=TorchAttention(),
        )
        with torch.no_grad(), attention_metadata(inputs.metadata), \
                set_forward_context(None, vllm_config, num_tokens=len(inputs.input_ids)):
            hidden = model(inputs.input_ids, inputs.positions)
            out.append(model.compute_logits(hidden).tolist())
    return out


if __name__ == "__main__":
    directory, token_json, ranges_json = sys.argv[1:4]
    result = main(directory, json.loads(token_json), json.loads(ranges_json))
    print("LOGITS " + json.dumps(result))
