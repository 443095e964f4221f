"""Tiny LLaDA checkpoints (`make_tiny --arch llada`): config.json with every real key
(sizes replaced), generation_config.json, configuration_llada.py, the real tensor
names (`model.transformer.wte` / `blocks.N.*` / `ln_f` / `ff_out`), a byte-level BPE
tokenizer.json with the LLaDA chat template, small or real special ids."""

from __future__ import annotations

import pathlib

from vllm_dllm.tools.hf_files import llada_special_ids, save_byte_level_bpe, write_llada_tokenizer_config
from vllm_dllm.tools.tiny_parts import (
    SMALL_VOCAB_SIZE,
    base_vocab,
    copy_config_module,
    linear,
    norm_weight,
    normal,
)

# (id, content) for the small LLaDA vocab. Ids differ from the real ones and
# the mask id sits between eos and the header tokens (not the largest id).
SMALL_LLADA_SPECIALS = [
    (296, "<|startoftext|>"),  # bos
    (297, "<|endoftext|>"),  # eos = pad
    (298, "<|mdm_mask|>"),  # mask
    (299, "<role>"),
    (300, "</role>"),
    (301, "<|start_header_id|>"),
    (302, "<|end_header_id|>"),
    (303, "<|eot_id|>"),
]
# rows 304..319 of the embedding / head have no token (like the real 126349..126463)

REAL_LLADA_VOCAB_SIZE = 126464
_REAL_LLADA_FIRST_ADDED = 126080

# LLaDA: bos before the first message; every message is
# <|start_header_id|>{role}<|end_header_id|>\n\n{content|trim}<|eot_id|>;
# the assistant header is ALWAYS appended (add_generation_prompt is ignored).


def _real_llada_specials() -> list[tuple[int, str]]:
    toks = [
        (126080, "<|startoftext|>"),
        (126081, "<|endoftext|>"),
        (126082, "[CLS]"),
        (126083, "[gMASK]"),
    ]
    for k in range(256):
        tid = 126084 + k
        toks.append((tid, "<|mdm_mask|>" if tid == 126336 else f"<|reserved_token_{k}|>"))
    toks += [
        (126340, "<role>"),
        (126341, "</role>"),
        (126342, "<|arithmetic_start|>"),
        (126343, "<|arithmetic_end|>"),
        (126344, "<|number_start|>"),
        (126345, "<|number_end|>"),
        (126346, "<|start_header_id|>"),
        (126347, "<|end_header_id|>"),
        (126348, "<|eot_id|>"),
    ]
    assert len(toks) == 269 and [t for t, _ in toks] == list(range(126080, 126349))
    return toks


def _llada_tokenizer(out: pathlib.Path, vocab_variant: str, max_len: int) -> dict[str, int]:
    if vocab_variant == "small":
        specials, first_added, vocab_size = SMALL_LLADA_SPECIALS, 296, SMALL_VOCAB_SIZE
    else:
        specials, first_added, vocab_size = _real_llada_specials(), _REAL_LLADA_FIRST_ADDED, REAL_LLADA_VOCAB_SIZE
    vocab, merges = base_vocab(first_added)
    # Specials live in the model vocab at their ids, so the added-token
    # entries of tokenizer.json keep exactly those ids.
    for tid, content in specials:
        assert tid == len(vocab)
        vocab[content] = tid

    save_byte_level_bpe(out, vocab, merges, [c for _, c in specials], use_regex=True)

    write_llada_tokenizer_config(out, specials, max_len)
    return llada_special_ids({c: t for t, c in specials}, vocab_size)


def llada_config(*, ids, hidden, layers, heads, kv_heads, intermediate, dtype, max_len) -> dict:
    return {
        "activation_type": "silu",
        "alibi": False,
        "alibi_bias_max": 8.0,
        "architectures": ["LLaDAModelLM"],
        "attention_dropout": 0.0,
        "attention_layer_norm": False,
        "attention_layer_norm_with_affine": True,
        "auto_map": {
            "AutoConfig": "configuration_llada.LLaDAConfig",
            "AutoModel": "modeling_llada.LLaDAModelLM",
            "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM",
        },
        "bias_for_layer_norm": False,
        "block_group_size": 1,
        "block_type": "llama",
        "d_model": hidden,
        "embedding_dropout": 0.0,
        "embedding_size": ids["vocab_size"],
        "eos_token_id": ids["eos"],
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
        "mask_token_id": ids["mask"],
        "max_sequence_length": max_len,
        "mlp_hidden_size": intermediate,
        "mlp_ratio": 4,
        "model_type": "llada",
        "multi_query_attention": None,
        "n_heads": heads,
        "n_kv_heads": kv_heads,
        "n_layers": layers,
        "pad_token_id": ids["eos"],
        "precision": "amp_bf16",
        "residual_dropout": 0.0,
        "rms_norm_eps": 1e-05,
        "rope": True,
        "rope_full_precision": True,
        "rope_theta": 500000.0,
        "scale_logits": False,
        "torch_dtype": dtype,
        "transformers_version": "4.46.2",
        "use_cache": False,
        "vocab_size": ids["vocab_size"],
        "weight_tying": False,
    }


def _llada_weights(gen, *, vocab_size, hidden, layers, heads, kv_heads, intermediate):
    head_dim = hidden // heads
    p = "model.transformer."
    w = {}
    w[p + "wte.weight"] = normal(gen, (vocab_size, hidden), 0.02)
    for i in range(layers):
        b = f"{p}blocks.{i}."
        w[b + "attn_norm.weight"] = norm_weight(gen, hidden)
        w[b + "q_proj.weight"] = linear(gen, heads * head_dim, hidden)
        w[b + "k_proj.weight"] = linear(gen, kv_heads * head_dim, hidden)
        w[b + "v_proj.weight"] = linear(gen, kv_heads * head_dim, hidden)
        w[b + "attn_out.weight"] = linear(gen, hidden, heads * head_dim)
        w[b + "ff_norm.weight"] = norm_weight(gen, hidden)
        w[b + "ff_proj.weight"] = linear(gen, intermediate, hidden)  # gate
        w[b + "up_proj.weight"] = linear(gen, intermediate, hidden)
        w[b + "ff_out.weight"] = linear(gen, hidden, intermediate)  # down
    w[p + "ln_f.weight"] = norm_weight(gen, hidden)
    w[p + "ff_out.weight"] = normal(gen, (vocab_size, hidden), 3.0 / hidden**0.5)  # LM head
    return w


def write(out: pathlib.Path, gen, *, vocab: str, dtype: str, max_len: int, sizes: dict):
    """The folder's files but the weights; returns (config, generation config, weights)."""
    ids = _llada_tokenizer(out, vocab, max_len)
    config = llada_config(ids=ids, dtype=dtype, max_len=max_len, **sizes)
    gen_config = {
        "_from_model_config": True,
        "bos_token_id": ids["bos"],
        "eos_token_id": ids["eos"],
        "transformers_version": "4.46.2",
    }
    copy_config_module(out, "llada.py", "configuration_llada.py")
    return config, gen_config, _llada_weights(gen, vocab_size=ids["vocab_size"], **sizes)
