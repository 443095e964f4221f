"""HF config / tokenizer classes for LLaDA, LLaDA-MoE, LLaDA2.x and Dream checkpoints.

Registering them (``vllm_dllm.families.register_hf_classes()``) makes ``AutoConfig.from_pretrained`` resolve
``model_type: "llada"`` / ``"llada2_moe"`` / ``"Dream"`` and ``AutoTokenizer.from_pretrained``
resolve ``tokenizer_class: "DreamTokenizer"`` without ``trust_remote_code``.
"llada" names two formats: LLaDA-8B's (OLMo keys) and LLaDA-MoE's (OLMoE keys); the
class registered for it reads the dict and builds the matching config.

How transformers (5.x) resolves the tokenizer for a Dream folder:

* ``tokenizer_class_from_name("DreamTokenizer")`` looks in
  ``REGISTERED_TOKENIZER_CLASSES``, which ``AutoTokenizer.register`` fills by
  class ``__name__``; so the registered class is found by the name written in
  tokenizer_config.json, whatever the config class is.
* Without ``trust_remote_code`` the registered class is used. Without
  registration the ``auto_map`` entry (``tokenization_dream.DreamTokenizer``)
  is used, which needs ``trust_remote_code=True``.
* With registration AND ``trust_remote_code=True`` the folder's
  ``tokenization_dream.py`` wins: a registered tokenizer only counts as
  "explicit local code" (which beats ``auto_map``) when the config class is
  *not* in ``TOKENIZER_MAPPING``, and ``DreamConfig`` is.

``AutoConfig`` (5.x) does use the "explicit local code" rule: once registered,
our config classes are used with or without ``trust_remote_code`` (4.x
preferred the folder's ``configuration_*.py`` with ``trust_remote_code=True``).
The files written by ``vllm_dllm.tools.make_tiny`` are copies of the modules
here, so every route gives the same attributes.
"""

from __future__ import annotations


from .dream import DreamConfig
from .dream_tokenizer import DreamTokenizer
from .llada import LLaDAConfig
from .llada2 import LLaDA2MoeConfig
from .llada_moe import LLaDAMoEConfig, is_llada_moe_format

__all__ = [
    "DreamConfig", "DreamTokenizer", "LLaDA2MoeConfig", "LLaDAConfig", "LLaDAFamilyConfig", "LLaDAMoEConfig",
]


class LLaDAFamilyConfig(LLaDAConfig):
    """What ``model_type: "llada"`` resolves to.  AutoConfig builds a config with
    ``from_dict``; this one returns a ``LLaDAMoEConfig`` for a LLaDA-MoE dict and a
    plain ``LLaDAConfig`` otherwise, so LLaDA-8B's defaults never leak into a MoE
    config (its mask id above all)."""

    @classmethod
    def from_dict(cls, config_dict, **kwargs):
        if is_llada_moe_format(config_dict):
            return LLaDAMoEConfig.from_dict(config_dict, **kwargs)
        return LLaDAConfig.from_dict(config_dict, **kwargs)
