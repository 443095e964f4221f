"""The served model families, one record each: what vLLM's registries and
transformers' Auto classes learn from the plugin, and how each family decodes.

A new model family is its files (an HF config class in configs/, the model on vLLM's
layers in models/) and one record in FAMILIES.  Its `kind` picks its decoding: the
options (options.KINDS) and the batched rule (decoding.rules.RULES).  A family that
decodes like an existing one reuses its kind, as LLaDA-MoE reuses LLaDA's.

Model classes are "module:Class" strings so that reading this module imports neither
vLLM nor the models: register() runs in every vLLM process, early.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_dllm.configs.llada_moe import LLADA_MOE_ARCHITECTURES
from vllm_dllm.options import DREAM, LLADA, LLADA2


@dataclass(frozen=True)
class ModelFamily:
    name: str  # as the docs and messages name it
    kind: str  # its decoding: options.KINDS[kind] and decoding.rules.RULES[kind]
    # The HF `architectures` served as this family, the released name first.
    architectures: tuple[str, ...]
    model: str  # the model class on vLLM's layers, registered for every architecture
    config: str  # the HF config class registered with AutoConfig for its model_type
    tokenizer: str | None = None  # a tokenizer class registered for `config`, if transformers has none
    moe: bool = False  # routed experts: vLLM's MoE layers (no data parallelism here)


FAMILIES: tuple[ModelFamily, ...] = (
    ModelFamily(
        name="LLaDA",
        kind=LLADA,
        architectures=("LLaDAModelLM",),
        model="vllm_dllm.models.llada:LLaDAModelLM",
        # "llada" names two formats; this class builds the one a config.json is in.
        config="vllm_dllm.configs:LLaDAFamilyConfig",
    ),
    ModelFamily(
        name="LLaDA-MoE",
        kind=LLADA,  # LLaDA with another body: the same options and rules
        # The released name, then spellings other tools use; the "llada" config
        # class tells a LLaDA-MoE config.json by the same names.
        architectures=LLADA_MOE_ARCHITECTURES,
        model="vllm_dllm.models.llada_moe:LLaDAMoEModelLM",
        config="vllm_dllm.configs:LLaDAFamilyConfig",
        moe=True,
    ),
    ModelFamily(
        name="Dream",
        kind=DREAM,
        architectures=("DreamModel",),
        model="vllm_dllm.models.dream:DreamModel",
        config="vllm_dllm.configs.dream:DreamConfig",
        tokenizer="vllm_dllm.configs.dream_tokenizer:DreamTokenizer",
    ),
    ModelFamily(
        name="LLaDA2.x",
        kind=LLADA2,
        architectures=("LLaDA2MoeModelLM",),
        model="vllm_dllm.models.llada2:LLaDA2MoeModelLM",
        config="vllm_dllm.configs.llada2:LLaDA2MoeConfig",
        moe=True,
    ),
)

BY_ARCHITECTURE: dict[str, ModelFamily] = {arch: family for family in FAMILIES for arch in family.architectures}


def family_of(hf_config) -> ModelFamily | None:
    """The family serving a model's HF config (by its first known architecture), or None."""
    for arch in getattr(hf_config, "architectures", None) or []:
        if arch in BY_ARCHITECTURE:
            return BY_ARCHITECTURE[arch]
    return None


def load_class(path: str) -> type:
    """The class a "module:Class" path names."""
    import importlib

    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


_hf_registered = False


def register_hf_classes() -> None:
    """Register each family's config class (and tokenizer, where it has its own) with
    the transformers Auto classes, so checkpoints load without trust_remote_code
    (configs/__init__.py says how transformers resolves them). Idempotent and cheap."""
    global _hf_registered
    if _hf_registered:
        return
    import inspect

    from transformers import AutoConfig, AutoTokenizer

    takes_class = "tokenizer_class" in inspect.signature(AutoTokenizer.register).parameters
    for family in FAMILIES:
        config = load_class(family.config)
        AutoConfig.register(config.model_type, config, exist_ok=True)
        if family.tokenizer is None:
            continue
        tokenizer = load_class(family.tokenizer)
        if takes_class:  # transformers >= 5
            AutoTokenizer.register(config, tokenizer_class=tokenizer, exist_ok=True)
        else:  # transformers 4.x: a slow tokenizer there
            AutoTokenizer.register(config, slow_tokenizer_class=tokenizer, exist_ok=True)
    _hf_registered = True
