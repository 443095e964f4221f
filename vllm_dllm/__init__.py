"""vllm-dllm: serve masked-diffusion language models (LLaDA, LLaDA-MoE, Dream, LLaDA2.x) with vLLM."""

from __future__ import annotations

__version__ = "0.1.0"

_registered = False


def register() -> None:
    """vLLM general-plugin entry point.  Idempotent; imports nothing heavy.

    It only adds entries for the architectures of the served families (families.py),
    so every other model is served exactly as without the plugin.
    """
    global _registered
    if _registered:
        return
    from vllm import ModelRegistry

    from vllm_dllm.families import register_hf_classes
    from vllm_dllm.families import BY_ARCHITECTURE
    from vllm_dllm.serving.compat import check_vllm_version, register_config_hook
    from vllm_dllm.models import cpu_rms_norm
    from vllm_dllm.serving.server_config import DiffusionConfigHook

    check_vllm_version()
    register_hf_classes()
    cpu_rms_norm.register()
    supported = set(ModelRegistry.get_supported_archs())
    for arch, family in BY_ARCHITECTURE.items():
        if arch not in supported:
            ModelRegistry.register_model(arch, family.model)
    register_config_hook(list(BY_ARCHITECTURE), DiffusionConfigHook)
    _registered = True
