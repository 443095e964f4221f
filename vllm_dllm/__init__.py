"""vllm-dllm: serve masked-diffusion language models (LLaDA, LLaDA-MoE, Dream, LLaDA2.x) with vLLM."""

from __future__ import annotations

__version__ = "0.1.0"

_MODELS = {
    "LLaDAModelLM": "vllm_dllm.models.llada:LLaDAModelLM",
    "DreamModel": "vllm_dllm.models.dream:DreamModel",
    "LLaDA2MoeModelLM": "vllm_dllm.models.llada2:LLaDA2MoeModelLM",
    # LLaDA-MoE, decoded as LLaDA; the released name first, then other spellings of
    # it (configs/llada_moe.py: LLADA_MOE_ARCHITECTURES).
    "LLaDAMoEModelLM": "vllm_dllm.models.llada_moe:LLaDAMoEModelLM",
    "LLaDAMoeModelLM": "vllm_dllm.models.llada_moe:LLaDAMoEModelLM",
    "LLaDAMoEModel": "vllm_dllm.models.llada_moe:LLaDAMoEModelLM",
}

_registered = False


def register() -> None:
    """vLLM general-plugin entry point.  Idempotent; imports nothing heavy.

    It only adds entries for the LLaDA, LLaDA-MoE, Dream and LLaDA2.x architectures, so every other model is
    served exactly as without the plugin.
    """
    global _registered
    if _registered:
        return
    from vllm import ModelRegistry

    from vllm_dllm.serving.compat import check_vllm_version, register_config_hook
    from vllm_dllm.configs import register_hf_classes
    from vllm_dllm.models import cpu_rms_norm
    from vllm_dllm.serving.server_config import DiffusionConfigHook

    check_vllm_version()
    register_hf_classes()
    cpu_rms_norm.register()
    supported = set(ModelRegistry.get_supported_archs())
    for arch, target in _MODELS.items():
        if arch not in supported:
            ModelRegistry.register_model(arch, target)
    register_config_hook(list(_MODELS), DiffusionConfigHook)
    _registered = True
