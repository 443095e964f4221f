"""Configuration class for LLaDA-MoE (``model_type: "llada"``, OLMoE-style keys).

Self-contained (imports only ``transformers``), like the other config modules: its
source is written into tiny checkpoint folders as ``configuration_lladamoe.py``, the
name the release's ``auto_map`` uses, whose class is ``LLaDAConfig`` (aliased below).

LLaDA-MoE shares ``model_type`` "llada" with LLaDA-8B but not its keys, so the class
registered for "llada" hands a dict in this format to this class (configs/__init__.py).
Defaults are the released class's where they mean something; its -1 placeholders for
the sizes are kept, a checkpoint's config.json sets them.  Its token-id defaults are
OLMoE's (pad 1, EOS 50279), not LLaDA-MoE's, so they are not copied: an id the
config.json leaves out is looked up in generation_config.json and the tokenizer
instead.  Likewise the release's config has no mask id (its generate() is called with
one), and nothing here invents one.
"""

from transformers import PretrainedConfig

__all__ = ["LLADA_MOE_ARCHITECTURES", "LLaDAMoEConfig", "is_llada_moe_format"]

# The released checkpoints say "LLaDAMoEModelLM"; the others are spellings other
# tools use for the same model (dInfer's class, the bare backbone).
LLADA_MOE_ARCHITECTURES = ("LLaDAMoEModelLM", "LLaDAMoeModelLM", "LLaDAMoEModel")

# Key -> default, in the order of the released configuration class.
_LLADA_MOE_DEFAULTS = {
    "vocab_size": -1,
    "hidden_size": -1,
    "dense_intermediate_size": -1,
    "expert_intermediate_size": -1,
    "shared_expert_intermediate_size": -1,
    "num_hidden_layers": -1,
    "num_attention_heads": -1,
    "num_key_value_heads": None,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-05,
    "rope_theta": -1,
    "partial_rotary_factor": -1,
    "rope_scaling": None,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "clip_qkv": None,
    "num_experts_per_tok": -1,
    "num_experts": -1,
    "output_router_logits": False,
    "router_aux_loss_coef": 0.01,
    "norm_topk_prob": None,
    "qk_layernorm": None,
    "moe_layer_freq": [],
    "moe_router_enable_expert_bias": None,
    "moe_router_score_function": None,
    "routed_scaling_factor": 1,
    "router_num_group": -2,
    "router_topk_group": -2,
}


def is_llada_moe_format(config_dict: dict) -> bool:
    """A "llada" config.json written for LLaDA-MoE rather than LLaDA-8B."""
    architectures = config_dict.get("architectures") or []
    return any(a in LLADA_MOE_ARCHITECTURES for a in architectures) or "moe_layer_freq" in config_dict


class LLaDAMoEConfig(PretrainedConfig):
    """LLaDA-MoE-7B-A1B (Base / Instruct) configuration.

    ``num_key_value_heads`` null means ``num_attention_heads``; ``moe_layer_freq`` has
    one entry per layer, 0 for a dense layer.  ``norm_topk_prob``,
    ``routed_scaling_factor`` and the router group keys are carried but the released
    model ignores them (its routing is fixed: softmax, biased, no renormalisation).
    """

    model_type = "llada"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(self, use_cache: bool = False, pad_token_id: int | None = None, bos_token_id: int | None = None,
                 eos_token_id: int | None = None, tie_word_embeddings: bool = False, **kwargs):
        for key, default in _LLADA_MOE_DEFAULTS.items():
            value = kwargs.pop(key, default)
            setattr(self, key, list(value) if isinstance(value, list) else value)
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.rope_scaling is not None and "type" in self.rope_scaling:
            self.rope_scaling["rope_type"] = self.rope_scaling["type"]
        self.use_cache = use_cache
        kwargs.setdefault("architectures", ["LLaDAMoEModelLM"])
        super().__init__(pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                         tie_word_embeddings=tie_word_embeddings, **kwargs)


# The name a checkpoint's auto_map gives the class.
LLaDAConfig = LLaDAMoEConfig
