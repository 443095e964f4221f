"""Tiny Dream checkpoints (`make_tiny --arch dream`): config.json with Qwen2 keys,
generation_config.json, configuration_dream.py, Qwen2 tensor names incl. q/k/v biases,
vocab.json + merges.txt + tokenization_dream.py (DreamTokenizer, Qwen2.5 chat
template), small or real special ids."""

from __future__ import annotations

import json
import pathlib

from vllm_dllm.tools.hf_files import DREAM_CHAT_TEMPLATE, added_token_entry, write_json
from vllm_dllm.tools.tiny_parts import (
    CONFIGS_DIR,
    SMALL_VOCAB_SIZE,
    base_vocab,
    copy_config_module,
    linear,
    norm_weight,
    normal,
)

# (id, content) for the small Dream vocab: vocab.json holds ids 0..295, the
# added tokens follow contiguously (tokenizers appends added tokens in order).
SMALL_DREAM_SPECIALS = [
    (296, "<|endoftext|>"),  # eos = pad = unk; also config bos_token_id
    (297, "<|im_start|>"),
    (298, "<|im_end|>"),
    (299, "<|mask|>"),  # mask
    (300, "<|beginoftext|>"),  # tokenizer bos
]

REAL_DREAM_VOCAB_SIZE = 152064
_REAL_DREAM_FIRST_ADDED = 151643


_QWEN_NON_SPECIAL = {
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
}


def _real_dream_specials() -> list[tuple[int, str]]:
    names = [
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
        "<|object_ref_start|>",
        "<|object_ref_end|>",
        "<|box_start|>",
        "<|box_end|>",
        "<|quad_start|>",
        "<|quad_end|>",
        "<|vision_start|>",
        "<|vision_end|>",
        "<|vision_pad|>",
        "<|image_pad|>",
        "<|video_pad|>",
        "<tool_call>",
        "</tool_call>",
        "<|fim_prefix|>",
        "<|fim_middle|>",
        "<|fim_suffix|>",
        "<|fim_pad|>",
        "<|repo_name|>",
        "<|file_sep|>",
        "<|beginoftext|>",
        "<|mask|>",
    ]
    toks = [(_REAL_DREAM_FIRST_ADDED + i, n) for i, n in enumerate(names)]
    assert toks[-1] == (151666, "<|mask|>") and toks[-2] == (151665, "<|beginoftext|>")
    return toks


def _dream_tokenizer(out: pathlib.Path, vocab_variant: str, max_len: int) -> dict[str, int]:
    if vocab_variant == "small":
        specials, first_added, vocab_size = SMALL_DREAM_SPECIALS, 296, SMALL_VOCAB_SIZE
    else:
        specials, first_added, vocab_size = _real_dream_specials(), _REAL_DREAM_FIRST_ADDED, REAL_DREAM_VOCAB_SIZE
    vocab, merges = base_vocab(first_added)
    for i, (tid, _) in enumerate(specials):
        assert tid == first_added + i

    (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (out / "merges.txt").write_text(
        "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8"
    )
    write_json(out / "added_tokens.json", {c: t for t, c in specials})
    (out / "tokenization_dream.py").write_text(
        (CONFIGS_DIR / "dream_tokenizer.py").read_text(encoding="utf-8"), encoding="utf-8"
    )
    extra = [c for _, c in specials if c not in ("<|endoftext|>", "<|beginoftext|>", "<|mask|>")]
    extra = [c for c in extra if c not in _QWEN_NON_SPECIAL]
    tokenizer_config = {
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(tid): added_token_entry(c, special=c not in _QWEN_NON_SPECIAL) for tid, c in specials
        },
        "additional_special_tokens": extra,
        "auto_map": {"AutoTokenizer": ["tokenization_dream.DreamTokenizer", None]},
        "bos_token": "<|beginoftext|>",
        "chat_template": DREAM_CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|endoftext|>",
        "errors": "replace",
        "mask_token": "<|mask|>",
        "model_max_length": max_len,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "DreamTokenizer",
        "unk_token": "<|endoftext|>",
    }
    write_json(out / "tokenizer_config.json", tokenizer_config)
    write_json(
        out / "special_tokens_map.json",
        {
            "additional_special_tokens": extra,
            "bos_token": added_token_entry("<|beginoftext|>"),
            "eos_token": added_token_entry("<|endoftext|>"),
            "mask_token": added_token_entry("<|mask|>"),
            "pad_token": added_token_entry("<|endoftext|>"),
            "unk_token": added_token_entry("<|endoftext|>"),
        },
    )
    ids = {c: t for t, c in specials}
    return {
        "vocab_size": vocab_size,
        "eos": ids["<|endoftext|>"],
        "bos": ids["<|beginoftext|>"],
        "mask": ids["<|mask|>"],
        "im_end": ids["<|im_end|>"],
    }


def _dream_config(*, ids, hidden, layers, heads, kv_heads, intermediate, dtype, max_len) -> dict:
    return {
        "architectures": ["DreamModel"],
        "attention_dropout": 0.0,
        "auto_map": {
            "AutoConfig": "configuration_dream.DreamConfig",
            "AutoModel": "modeling_dream.DreamModel",
        },
        "bos_token_id": ids["eos"],
        "eos_token_id": ids["eos"],
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": intermediate,
        "mask_token_id": ids["mask"],
        "max_position_embeddings": max_len,
        "max_window_layers": layers,
        "model_type": "Dream",
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "num_key_value_heads": kv_heads,
        "pad_token_id": ids["eos"],
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "transformers_version": "4.46.2",
        "use_cache": True,
        "use_mrope": False,
        "use_sliding_window": False,
        "vocab_size": ids["vocab_size"],
    }


def _dream_generation_config(ids) -> dict:
    return {
        "_from_model_config": True,
        "alg": "origin",
        "alg_temp": None,
        "bos_token_id": ids["eos"],
        "eos_token_id": ids["eos"],
        "eps": 0.001,
        "mask_token_id": None,
        "output_history": False,
        "pad_token_id": ids["eos"],
        "steps": 512,
        "temperature": 0.0,
        "top_k": None,
        "top_p": None,
        "transformers_version": "4.46.2",
    }


def _dream_weights(gen, *, vocab_size, hidden, layers, heads, kv_heads, intermediate):
    head_dim = hidden // heads
    w = {}
    w["model.embed_tokens.weight"] = normal(gen, (vocab_size, hidden), 0.02)
    for i in range(layers):
        b = f"model.layers.{i}."
        w[b + "input_layernorm.weight"] = norm_weight(gen, hidden)
        w[b + "self_attn.q_proj.weight"] = linear(gen, heads * head_dim, hidden)
        w[b + "self_attn.q_proj.bias"] = normal(gen, (heads * head_dim,), 0.02)
        w[b + "self_attn.k_proj.weight"] = linear(gen, kv_heads * head_dim, hidden)
        w[b + "self_attn.k_proj.bias"] = normal(gen, (kv_heads * head_dim,), 0.02)
        w[b + "self_attn.v_proj.weight"] = linear(gen, kv_heads * head_dim, hidden)
        w[b + "self_attn.v_proj.bias"] = normal(gen, (kv_heads * head_dim,), 0.02)
        w[b + "self_attn.o_proj.weight"] = linear(gen, hidden, heads * head_dim)
        w[b + "post_attention_layernorm.weight"] = norm_weight(gen, hidden)
        w[b + "mlp.gate_proj.weight"] = linear(gen, intermediate, hidden)
        w[b + "mlp.up_proj.weight"] = linear(gen, intermediate, hidden)
        w[b + "mlp.down_proj.weight"] = linear(gen, hidden, intermediate)
    w["model.norm.weight"] = norm_weight(gen, hidden)
    w["lm_head.weight"] = normal(gen, (vocab_size, hidden), 3.0 / hidden**0.5)
    return w


def write(out: pathlib.Path, gen, *, vocab: str, dtype: str, max_len: int, sizes: dict):
    """The folder's files but the weights; returns (config, generation config, weights)."""
    ids = _dream_tokenizer(out, vocab, max_len)
    config = _dream_config(ids=ids, dtype=dtype, max_len=max_len, **sizes)
    copy_config_module(out, "dream.py", "configuration_dream.py")
    return config, _dream_generation_config(ids), _dream_weights(gen, vocab_size=ids["vocab_size"], **sizes)
