"""Carving vLLM's KV allocation into per-layer page tensors for diffusion attention."""

from __future__ import annotations

import math

import torch
from vllm.v1.kv_cache_interface import KVCacheConfig

from vllm_dllm.attention.paged import DiffusionAttention, kv_page_shape


def bind_kv_pool(
    kv_cache_config: KVCacheConfig,
    layers: list[DiffusionAttention],
    dtype: torch.dtype,
    device: torch.device,
) -> list[torch.Tensor]:
    """Allocate the pool vLLM planned and bind each layer's view of it.

    Each KVCacheTensor is one raw byte buffer; layer l's page for block b starts at
    offset + l * layer_stride + b * block_stride bytes.  Within a page we store
    [block_size, 2 (K, V), kv_heads, head_dim].
    """
    by_name = {layer.layer_name: layer for layer in layers}
    num_blocks = kv_cache_config.num_blocks
    group_spec = {name: g.kv_cache_spec for g in kv_cache_config.kv_cache_groups for name in g.layer_names}
    elem = torch.empty((), dtype=dtype).element_size()
    views = []
    for tensor in kv_cache_config.kv_cache_tensors:
        raw = torch.zeros(tensor.size, dtype=torch.int8, device=device)
        for index, name in enumerate(tensor.layers):
            layer = by_name[name]
            spec = group_spec[name]
            page_shape = kv_page_shape(spec.block_size, layer.num_kv_heads, layer.head_dim)
            page_bytes = math.prod(page_shape) * elem
            if page_bytes > spec.page_size_bytes:
                raise ValueError(f"KV page of {name} is {spec.page_size_bytes} bytes, need {page_bytes}")
            pages = torch.as_strided(
                raw,
                size=(num_blocks, page_bytes),
                stride=(tensor.block_stride, 1),
                storage_offset=tensor.offset + index * tensor.layer_stride,
            )
            view = pages.view(dtype).unflatten(1, page_shape)
            layer.bind_kv_cache(view)
            views.append(view)
    return views
