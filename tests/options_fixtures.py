"""What the options tests share: server defaults per kind and one request's resolution."""

from __future__ import annotations

from vllm_dllm.options import DREAM, LLADA, resolve
from vllm_dllm.serving.server_defaults import ServerDefaults


def llada(gen_config=None, server=None) -> ServerDefaults:
    return ServerDefaults.build(LLADA, gen_config or {}, server or {})


def dream(gen_config=None, server=None) -> ServerDefaults:
    return ServerDefaults.build(DREAM, gen_config or {}, server or {})


def res(defaults, extra=None, *, max_tokens=64, temperature=0.0, top_p=1.0, top_k=0):
    return resolve(
        defaults,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        extra_args=extra,
    )
