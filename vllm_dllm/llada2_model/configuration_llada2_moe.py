"""Configuration class for LLaDA2.x (``model_type: "llada2_moe"``, Ling 2.0 keys).

Self-contained (imports only ``transformers``), like the other config modules: its
source is written into tiny checkpoint folders as ``configuration_llada2_moe.py``.

Defaults are those of the released configuration class; a checkpoint's config.json
sets the real sizes.  Keys the released class leaves to ``**kwargs`` but the model
reads (``score_function``, ``moe_router_enable_expert_bias``, ``router_dtype``,
``norm_topk_prob``) are spelled out with the values the released checkpoints use.
The release's config has no mask id: generation_config.json or the tokenizer says it.
"""

from transformers import PretrainedConfig

__all__ = ["LLaDA2MoeConfig"]

# Key -> default.
_LLADA2_DEFAULTS = {
    "vocab_size": 30592,
    "hidden_size": 1024,
    "intermediate_size": None,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_key_value_heads": 0,
    "hidden_act": "silu",
    "use_qkv_bias": False,
    "use_qk_norm": True,
    "use_bias": True,
    "rms_norm_eps": 1e-05,
    "norm_head": False,
    "embedding_dropout": 0.1,
    "attention_dropout": 0.1,
    "output_dropout": 0.1,
    "initializer_range": 0.02,
    "max_position_embeddings": 16384,
    "rope_theta": 10000.0,
    "use_sliding_window": False,
    "sliding_window": 4096,
    "max_window_layers": 28,
    "rope_scaling": None,
    "num_experts": 16,
    "num_shared_experts": 0,
    "num_experts_per_tok": 2,
    "n_group": 8,
    "topk_group": 4,
    "routed_scaling_factor": 2.5,
    "moe_intermediate_size": None,
    "first_k_dense_replace": 0,
    "output_router_logits": False,
    "partial_rotary_factor": 0.5,
    "score_function": "sigmoid",
    "moe_router_enable_expert_bias": True,
    "router_dtype": "fp32",
    "norm_topk_prob": True,
}


class LLaDA2MoeConfig(PretrainedConfig):
    """LLaDA2.0 / 2.1 (mini, flash) configuration.

    ``head_dim`` defaults to ``hidden_size // num_attention_heads``;
    ``num_key_value_heads`` 0 or null means ``num_attention_heads``.
    """

    model_type = "llada2_moe"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(self, use_cache: bool = True, pad_token_id: int | None = None, tie_word_embeddings: bool = False,
                 head_dim: int | None = None, **kwargs):
        for key, default in _LLADA2_DEFAULTS.items():
            setattr(self, key, kwargs.pop(key, default))
        if not self.num_key_value_heads:
            self.num_key_value_heads = self.num_attention_heads
        self.head_dim = head_dim or self.hidden_size // self.num_attention_heads
        self.use_cache = use_cache
        kwargs.setdefault("architectures", ["LLaDA2MoeModelLM"])
        super().__init__(pad_token_id=pad_token_id, tie_word_embeddings=tie_word_embeddings, **kwargs)
