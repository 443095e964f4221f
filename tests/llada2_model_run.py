"""Run the plugin's LLaDA2 model (vLLM's layers and fused MoE, our paged attention) on
block-causal query segments and print its logits as JSON.

A script, run in a child process by tests/engine/test_llada2_model.py: building a vLLM model
outside an engine initialises vLLM's process-wide distributed state, which must not
leak into the test process that later starts engines.

    python tests/llada2_model_run.py MODEL_DIR BLOCK_LENGTH TOKENS_JSON STEPS_JSON

STEPS_JSON: a list of forwards, each a list of block indices whose queries run in that
forward over the K/V the pool holds from earlier forwards (a chunked prefill, a
denoising step of one block, a boundary step of two blocks).  Prints, per forward, the
logits of its query rows.
"""

from __future__ import annotations

import json
import socket
import sys

import numpy as np
import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_model(model_dir: str):
    from vllm import ModelRegistry
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model

    from vllm_dllm.families import BY_ARCHITECTURE, register_hf_classes

    register_hf_classes()
    if not torch.accelerator.is_available():
        # vLLM's CPU worker does the same before loading: the loader empties the
        # accelerator's cache, which a CPU-only torch refuses.
        torch.accelerator.empty_cache = lambda *args, **kwargs: None
    for architecture, family in BY_ARCHITECTURE.items():  # the models only: no config hook
        ModelRegistry.register_model(architecture, family.model)
    vllm_config = EngineArgs(model=model_dir, dtype="float32", max_model_len=256, enforce_eager=True,
                             gpu_memory_utilization=0.3).create_engine_config()
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                     distributed_init_method=f"tcp://127.0.0.1:{free_port()}", backend="gloo")
        initialize_model_parallel(1, 1)
        model = get_model(vllm_config=vllm_config)
    return model, vllm_config


def main(model_dir: str, block_length: int, tokens: list[int], steps: list[list[int]]) -> list:
    from vllm.forward_context import set_forward_context

    from vllm_dllm.attention.backends import TorchAttention
    from vllm_dllm.attention.metadata import attention_metadata
    from vllm_dllm.engine.step_inputs import SequenceLayout, build_step_inputs

    model, vllm_config = build_model(model_dir)
    page = 16
    layers = model.model.attention_layers()
    num_pages = -(-len(tokens) // page) + 1
    for layer in layers:
        layer.bind_kv_cache(torch.zeros(num_pages, page, 2, layer.num_kv_heads, layer.head_dim))
    block_table = torch.arange(num_pages, dtype=torch.int32)[None, :]
    prompt = torch.tensor([tokens])
    out = []
    for blocks in steps:
        blocks = np.array(blocks, dtype=np.int64)
        starts = blocks * block_length
        ends = np.minimum(starts + block_length, len(tokens))
        zeros = np.zeros(len(blocks), dtype=np.int64)
        layout = SequenceLayout(slot=zeros, twin=zeros.astype(bool), query_start=starts, num_queries=ends - starts,
                                seq_len=ends, kv_start=zeros)
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
    directory, block, token_json, steps_json = sys.argv[1:5]
    result = main(directory, int(block), json.loads(token_json), json.loads(steps_json))
    print("LOGITS " + json.dumps(result))
