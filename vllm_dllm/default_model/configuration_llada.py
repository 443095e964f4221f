"""Configuration class for LLaDA (``model_type: "llada"``).

This module is self-contained on purpose: it imports only ``transformers`` and
the standard library, because its source is also written into checkpoint
folders as ``configuration_llada.py`` (``auto_map`` / ``trust_remote_code``).
Do not add package-relative imports here.

Every key of the real LLaDA-8B ``config.json`` is accepted; the defaults are
the real LLaDA-8B values (not the GPT-2-like defaults of the original
``ModelConfig`` dataclass), so a config.json that omits a key still describes
the LLaDA architecture. The standard names that vLLM and transformers read
(``hidden_size``, ``num_attention_heads``, ``num_hidden_layers``,
``num_key_value_heads``, ``intermediate_size``, ``max_position_embeddings``,
``head_dim``) are derived from the LLaDA names.
"""

from transformers import PretrainedConfig

__all__ = ["LLaDAConfig"]

# Key -> default, in the order of the real config.json (LLaDA-8B-Instruct).
_LLADA_DEFAULTS = {
    "activation_type": "silu",
    "alibi": False,
    "alibi_bias_max": 8.0,
    "attention_dropout": 0.0,
    "attention_layer_norm": False,
    "attention_layer_norm_with_affine": True,
    "bias_for_layer_norm": False,
    "block_group_size": 1,
    "block_type": "llama",
    "d_model": 4096,
    "embedding_dropout": 0.0,
    "embedding_size": 126464,
    "flash_attention": False,
    "include_bias": False,
    "include_qkv_bias": False,
    "init_cutoff_factor": None,
    "init_device": "meta",
    "init_fn": "mitchell",
    "init_std": 0.02,
    "input_emb_norm": False,
    "layer_norm_type": "rms",
    "layer_norm_with_affine": True,
    "mask_token_id": 126336,
    "max_sequence_length": 4096,
    "mlp_hidden_size": 12288,
    "mlp_ratio": 4,
    "multi_query_attention": None,
    "n_heads": 32,
    "n_kv_heads": 32,
    "n_layers": 32,
    "pad_token_id": 126081,
    "precision": "amp_bf16",
    "residual_dropout": 0.0,
    "rms_norm_eps": 1e-05,
    "rope": True,
    "rope_full_precision": True,
    "rope_theta": 500000.0,
    "scale_logits": False,
    "vocab_size": 126464,
    "weight_tying": False,
    "eos_token_id": 126081,
}


class LLaDAConfig(PretrainedConfig):
    """LLaDA-8B style config (OLMo-derived key names).

    Standard aliases:

    * ``hidden_size`` -> ``d_model``
    * ``num_attention_heads`` -> ``n_heads``
    * ``num_hidden_layers`` -> ``n_layers``
    * ``max_position_embeddings`` -> ``max_sequence_length``
    * ``num_key_value_heads``: ``n_kv_heads``, or 1 with multi-query attention,
      or ``n_heads`` when null
    * ``intermediate_size``: ``mlp_hidden_size``, or ``mlp_ratio * d_model``
      when null
    * ``head_dim``: ``d_model // n_heads``
    * ``tie_word_embeddings``: ``weight_tying``
    """

    model_type = "llada"
    keys_to_ignore_at_inference = ["past_key_values"]
    attribute_map = {
        "hidden_size": "d_model",
        "num_attention_heads": "n_heads",
        "num_hidden_layers": "n_layers",
        "max_position_embeddings": "max_sequence_length",
    }

    def __init__(self, use_cache: bool = False, **kwargs):
        values = {}
        for key, default in _LLADA_DEFAULTS.items():
            values[key] = kwargs.pop(key, default)
        # Standard names passed by generic tooling map onto the LLaDA names.
        for std_name, llada_name in type(self).attribute_map.items():
            if std_name in kwargs:
                values[llada_name] = kwargs.pop(std_name)
        if "num_key_value_heads" in kwargs:
            values["n_kv_heads"] = kwargs.pop("num_key_value_heads")
        if "intermediate_size" in kwargs:
            values["mlp_hidden_size"] = kwargs.pop("intermediate_size")
        if "tie_word_embeddings" in kwargs:
            values["weight_tying"] = bool(kwargs.pop("tie_word_embeddings"))
        kwargs.pop("head_dim", None)  # always derived
        kwargs.setdefault("architectures", ["LLaDAModelLM"])
        # Token ids go through the base class too (older transformers
        # versions reset them otherwise), then are set again below.
        for key in ("eos_token_id", "pad_token_id"):
            kwargs[key] = values[key]
        super().__init__(**kwargs)
        # Set after the base __init__: it may drop generation-type keys
        # (use_cache) or reset some fields to its own defaults.
        for key, value in values.items():
            setattr(self, key, value)
        self.use_cache = use_cache

    # ---- derived standard names -------------------------------------------

    @property
    def num_key_value_heads(self) -> int:
        if self.n_kv_heads is not None:
            return self.n_kv_heads
        if self.multi_query_attention:
            return 1
        return self.n_heads

    @num_key_value_heads.setter
    def num_key_value_heads(self, value) -> None:
        self.n_kv_heads = value

    @property
    def intermediate_size(self) -> int:
        if self.mlp_hidden_size is not None:
            return self.mlp_hidden_size
        return self.mlp_ratio * self.d_model

    @intermediate_size.setter
    def intermediate_size(self, value) -> None:
        self.mlp_hidden_size = value

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @head_dim.setter
    def head_dim(self, value) -> None:
        if value is not None and value != self.d_model // self.n_heads:
            raise ValueError(
                f"LLaDA head_dim is d_model // n_heads = {self.d_model // self.n_heads}, got {value}"
            )

    @property
    def tie_word_embeddings(self) -> bool:
        return bool(getattr(self, "weight_tying", False))

    @tie_word_embeddings.setter
    def tie_word_embeddings(self, value) -> None:
        # The base class may assign its own default before our __init__ body
        # has set ``weight_tying``; the value from config.json wins afterwards.
        self.__dict__["weight_tying"] = bool(value)
