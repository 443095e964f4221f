"""Configuration class for Dream (``model_type: "Dream"``), Qwen2-style keys.

This module is self-contained on purpose: it imports only ``transformers`` and
the standard library, because its source is also written into checkpoint
folders as ``configuration_dream.py`` (``auto_map`` / ``trust_remote_code``).
Do not add package-relative imports here.

Defaults are the real Dream-v0-7B values (hidden 3584, 28 layers, 28 heads /
4 KV heads, vocab 152064, mask id 151666, ...).
"""

from transformers import PretrainedConfig

__all__ = ["DreamConfig"]

# Key -> default (real Dream-v0-Instruct-7B config.json).
_DREAM_DEFAULTS = {
    "vocab_size": 152064,
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "hidden_act": "silu",
    "max_position_embeddings": 131072,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "rope_scaling": None,
    "use_sliding_window": False,
    "sliding_window": None,
    "max_window_layers": 28,
    "use_mrope": False,
    "attention_dropout": 0.0,
    "tie_word_embeddings": False,
    "mask_token_id": 151666,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "pad_token_id": 151643,
}


class DreamConfig(PretrainedConfig):
    """Dream-v0-7B style config (Qwen2 key names plus ``mask_token_id``).

    ``num_key_value_heads`` null means ``num_attention_heads``; ``head_dim`` is
    ``hidden_size // num_attention_heads`` unless config.json sets it.
    """

    model_type = "Dream"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(self, use_cache: bool = True, **kwargs):
        values = {}
        for key, default in _DREAM_DEFAULTS.items():
            values[key] = kwargs.pop(key, default)
        if values["num_key_value_heads"] is None:
            values["num_key_value_heads"] = values["num_attention_heads"]
        head_dim = kwargs.pop("head_dim", None)
        kwargs.setdefault("architectures", ["DreamModel"])
        # Token ids and tying go through the base class too (older
        # transformers versions reset them otherwise), then are set again.
        for key in ("bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings"):
            kwargs[key] = values[key]
        super().__init__(**kwargs)
        # Set after the base __init__: it may drop generation-type keys
        # (use_cache) or reset some fields to its own defaults.
        for key, value in values.items():
            setattr(self, key, value)
        self.use_cache = use_cache
        if head_dim is not None:
            self.head_dim = head_dim

    @property
    def head_dim(self) -> int:
        # An explicit value (config.json "head_dim") lives in the instance
        # dict under the same name, so it serialises as "head_dim".
        explicit = self.__dict__.get("head_dim")
        if explicit is not None:
            return explicit
        return self.hidden_size // self.num_attention_heads

    @head_dim.setter
    def head_dim(self, value) -> None:
        self.__dict__["head_dim"] = value
