"""The LM head under tensor parallelism: each rank projects its own vocabulary
columns, and the rules reduce them through a `VocabShard` whose all-gather is the
TP group's (decoding/vocab.py).  vLLM's LogitsProcessor would all-gather every
logits row whole; here a chunk sends a few numbers per row."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from vllm.distributed import get_tensor_model_parallel_world_size, tensor_model_parallel_all_gather
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

from vllm_dllm.decoding.logits import LMHead
from vllm_dllm.decoding.vocab import VocabShard


def gather_over_tp(t: torch.Tensor) -> torch.Tensor:
    """[rows, k] on every rank -> [world, rows, k], in rank order.  float64 travels
    as its bits in float32 pairs: vLLM's CPU shared-memory all-gather has no float64
    kernel, and a gather only moves bits.  Nothing to send (top-0 logprobs) sends
    nothing: the shared-memory gather does not take empty tensors, and every rank
    holds the same shapes."""
    if t.numel() == 0:
        return t.new_empty((get_tensor_model_parallel_world_size(), *t.shape))
    wide = t.dtype == torch.float64
    sent = t.contiguous().view(torch.float32) if wide else t.contiguous()
    gathered = tensor_model_parallel_all_gather(sent.unsqueeze(0), dim=0)
    return gathered.view(torch.float64) if wide else gathered


def shard_logits(head: ParallelLMHead, head_dtype: torch.dtype | None, hidden_rows: torch.Tensor) -> torch.Tensor:
    """This rank's logits columns for `hidden_rows`: its vocabulary shard, without
    the shard's padding.  `head_dtype` (vLLM's `--hf-overrides '{"head_dtype": ...}'`)
    projects in that dtype, as LogitsProcessor does on one rank (a plain weight only)."""
    columns = head.shard_indices.num_org_elements
    if head_dtype is not None and head_dtype != hidden_rows.dtype:
        return F.linear(hidden_rows.to(head_dtype), head.weight[:columns].to(head_dtype))
    return head.quant_method.apply(head, hidden_rows, bias=None)[:, :columns]


def vocab_parallel_head(head: torch.nn.Module, head_dtype: torch.dtype | None = None) -> LMHead | None:
    """The sharded LM head of a TP model; None for a head that holds the whole
    vocabulary (one rank, or a plain torch model): the model's own compute_logits."""
    if not isinstance(head, ParallelLMHead) or head.tp_size == 1:
        return None
    shard = head.shard_indices
    vocab = VocabShard(shard.org_vocab_start_index, shard.org_vocab_end_index, head.org_vocab_size,
                       head.tp_rank, gather_over_tp)
    return LMHead(functools.partial(shard_logits, head, head_dtype), vocab)
