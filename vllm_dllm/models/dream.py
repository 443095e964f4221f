"""Dream-v0 7B (Instruct / Base): `DreamModel` checkpoints with Qwen2 names."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from vllm.config import VllmConfig

from vllm_dllm.models.diffusion_lm import DiffusionLM
from vllm_dllm.models.transformer import TransformerShape
from vllm_dllm.models.weights import layer, rules

_P = r"model\.layers\.{i}\."
_DREAM_NAMES = rules(
    (r"model\.embed_tokens\.weight", "model.embed.weight"),
    (r"model\.norm\.weight", "model.final_norm.weight"),
    (r"lm_head\.weight", "model.lm_head.weight"),
    (layer(_P + r"input_layernorm\.weight"), r"model.layers.\1.input_norm.weight"),
    (layer(_P + r"post_attention_layernorm\.weight"), r"model.layers.\1.post_attn_norm.weight"),
    (layer(_P + r"self_attn\.q_proj\.(weight|bias)"), r"model.layers.\1.attn.qkv_proj.\2", "q"),
    (layer(_P + r"self_attn\.k_proj\.(weight|bias)"), r"model.layers.\1.attn.qkv_proj.\2", "k"),
    (layer(_P + r"self_attn\.v_proj\.(weight|bias)"), r"model.layers.\1.attn.qkv_proj.\2", "v"),
    (layer(_P + r"self_attn\.o_proj\.weight"), r"model.layers.\1.attn.o_proj.weight"),
    (layer(_P + r"mlp\.gate_proj\.weight"), r"model.layers.\1.mlp.gate_up_proj.weight", 0),
    (layer(_P + r"mlp\.up_proj\.weight"), r"model.layers.\1.mlp.gate_up_proj.weight", 1),
    (layer(_P + r"mlp\.down_proj\.weight"), r"model.layers.\1.mlp.down_proj.weight"),
)


def dream_shape(config) -> TransformerShape:
    if getattr(config, "tie_word_embeddings", False):
        raise ValueError("Dream checkpoints with tied embeddings are not supported")
    if getattr(config, "use_sliding_window", False):
        raise ValueError("Dream with sliding-window attention is not supported")
    hidden = config.hidden_size
    heads = config.num_attention_heads
    return TransformerShape(
        vocab_size=config.vocab_size,
        hidden_size=hidden,
        intermediate_size=config.intermediate_size,
        num_layers=config.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=hidden // heads,
        rms_norm_eps=config.rms_norm_eps,
        rope_theta=getattr(config, "rope_theta", 10000.0),
        max_position=getattr(config, "max_position_embeddings", 32768),
        qkv_bias=True,
    )


class DreamModel(DiffusionLM):
    logits_shift = True

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__(dream_shape(vllm_config.model_config.hf_config), vllm_config, prefix)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        # Some exports carry rotary caches; they are recomputed from rope_theta.
        return self.load_with_rules(
            ((name, tensor) for name, tensor in weights if not name.endswith("rotary_emb.inv_freq")),
            _DREAM_NAMES,
        )
