"""Tiny random LLaDA2.x checkpoints in the released file format (`make_tiny --arch llada2`).

Written: ``config.json`` (the release's keys, sizes replaced; ``model_type``
"llada2_moe", ``architectures`` ["LLaDA2MoeModelLM"]), ``generation_config.json``
(the mask and EOS ids, which the released config does not carry), a copy of
``configuration_llada2_moe.py``, ``model.safetensors`` with the released tensor names
(``model.word_embeddings``, ``model.layers.N.attention.query_key_value`` /
``query_layernorm`` / ``key_layernorm`` / ``dense``, ``mlp.gate.weight`` and
``mlp.gate.expert_bias``, ``mlp.experts.E.{gate,up,down}_proj``,
``mlp.shared_experts.*``, a dense ``mlp.*`` in the first layers, ``model.norm``,
``lm_head``) and a byte-level BPE tokenizer whose special ids differ from the release's
(EOS 156892, mask 156895 there), so nothing can rely on those numbers.

Routing is made non-trivial on purpose: several expert groups of which only some are
kept, a selection bias large enough to change which experts win (and so different
from the weights' own order), a shared expert, a dense first layer.
"""

from __future__ import annotations

import pathlib

from vllm_dllm.tools.hf_files import added_token_entry, save_byte_level_bpe, write_json
from vllm_dllm.tools.tiny_parts import (
    SMALL_VOCAB_SIZE,
    base_vocab,
    copy_config_module,
    linear,
    norm_weight,
    normal,
)

# (id, content): ids differ from the release's.
SMALL_LLADA2_SPECIALS = [
    (296, "<|startoftext|>"),
    (297, "<|endoftext|>"),  # EOS
    (298, "<role>"),
    (299, "</role>"),
    (300, "<|role_end|>"),
    (301, "<|mask|>"),  # the mask: not next to EOS, not the largest id
    (302, "<|number_start|>"),
    (303, "<|number_end|>"),
]

# Ling's chat frame: <role>SYSTEM|HUMAN|ASSISTANT</role>, each turn closed by <|role_end|>.
LLADA2_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}<role>SYSTEM</role>"
    "{% elif message['role'] == 'user' %}<role>HUMAN</role>"
    "{% else %}<role>ASSISTANT</role>{% endif %}"
    "{{ message['content'] }}<|role_end|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<role>ASSISTANT</role>{% endif %}"
)

DEFAULT_MOE = dict(num_experts=16, experts_per_token=4, n_group=4, topk_group=2, moe_intermediate=32,
                   shared_experts=1, dense_layers=1)


def write_tokenizer(out: pathlib.Path, vocab: dict[str, int], merges, max_len: int, *, use_regex: bool = True,
                    vocab_size: int = SMALL_VOCAB_SIZE) -> dict[str, int]:
    """The Ling specials right after `vocab` (the small vocabulary puts them at
    SMALL_LLADA2_SPECIALS' ids; the task model's vocabulary, lab/training, after
    its own tokens), the tokenizer files, and the ids (`vocab_size`: embedding rows)."""
    first = len(vocab)
    numbered = [(first + i, content) for i, (_, content) in enumerate(SMALL_LLADA2_SPECIALS)]
    if vocab_size == SMALL_VOCAB_SIZE:
        assert numbered == SMALL_LLADA2_SPECIALS
    if numbered[-1][0] >= vocab_size:
        raise ValueError(f"{numbered[-1][0] + 1} tokens do not fit {vocab_size} embedding rows")
    for tid, content in numbered:
        vocab[content] = tid
    specials = [c for _, c in numbered]
    save_byte_level_bpe(out, vocab, merges, specials, use_regex=use_regex)
    write_json(out / "tokenizer_config.json", {
        "add_bos_token": False,
        "add_eos_token": False,
        "added_tokens_decoder": {str(t): added_token_entry(c) for t, c in numbered},
        "bos_token": "<|startoftext|>",
        "chat_template": LLADA2_CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|endoftext|>",
        "mask_token": "<|mask|>",
        "model_max_length": max_len,
        "pad_token": "<|endoftext|>",
        "tokenizer_class": "PreTrainedTokenizerFast",
    })
    write_json(out / "special_tokens_map.json", {
        "bos_token": added_token_entry("<|startoftext|>"),
        "eos_token": added_token_entry("<|endoftext|>"),
        "mask_token": added_token_entry("<|mask|>"),
        "pad_token": added_token_entry("<|endoftext|>"),
    })
    ids = {c: t for t, c in numbered}
    return {"vocab_size": vocab_size, "eos": ids["<|endoftext|>"], "mask": ids["<|mask|>"],
            "bos": ids["<|startoftext|>"]}


def config(*, ids, hidden, layers, heads, kv_heads, intermediate, dtype, max_len, moe, head_dim=None) -> dict:
    return {
        "architectures": ["LLaDA2MoeModelLM"],
        "attention_dropout": 0.0,
        "auto_map": {
            "AutoConfig": "configuration_llada2_moe.LLaDA2MoeConfig",
            "AutoModel": "modeling_llada2_moe.LLaDA2MoeModel",
            "AutoModelForCausalLM": "modeling_llada2_moe.LLaDA2MoeModelLM",
        },
        "embedding_dropout": 0.0,
        "eos_token_id": ids["eos"],
        "first_k_dense_replace": moe["dense_layers"],
        "head_dim": head_dim or hidden // heads,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": intermediate,
        "max_position_embeddings": max_len,
        "max_window_layers": layers,
        "model_type": "llada2_moe",
        "moe_intermediate_size": moe["moe_intermediate"],
        "moe_router_enable_expert_bias": True,
        "n_group": moe["n_group"],
        "norm_head": False,
        "norm_topk_prob": True,
        "num_attention_heads": heads,
        "num_experts": moe["num_experts"],
        "num_experts_per_tok": moe["experts_per_token"],
        "num_hidden_layers": layers,
        "num_key_value_heads": kv_heads,
        "num_shared_experts": moe["shared_experts"],
        "output_dropout": 0.0,
        "output_router_logits": False,
        "pad_token_id": ids["eos"],
        "partial_rotary_factor": 0.5,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 600000,
        "routed_scaling_factor": 2.5,
        "router_dtype": "fp32",
        "score_function": "sigmoid",
        "tie_word_embeddings": False,
        "topk_group": moe["topk_group"],
        "torch_dtype": dtype,
        "transformers_version": "4.52.3",
        "use_bias": False,
        "use_cache": False,
        "use_qk_norm": True,
        "use_qkv_bias": False,
        "use_rmsnorm": True,
        "use_sliding_window": False,
        "vocab_size": ids["vocab_size"],
    }


def generation_config(ids) -> dict:
    return {"eos_token_id": ids["eos"], "mask_token_id": ids["mask"], "pad_token_id": ids["eos"],
            "transformers_version": "4.52.3"}


def weights(gen, *, vocab_size, hidden, layers, heads, kv_heads, intermediate, moe):
    head_dim = hidden // heads
    w = {"model.word_embeddings.weight": normal(gen, (vocab_size, hidden), 0.02)}
    for i in range(layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm_weight(gen, hidden)
        w[p + "attention.query_key_value.weight"] = linear(gen, (heads + 2 * kv_heads) * head_dim, hidden)
        w[p + "attention.query_layernorm.weight"] = norm_weight(gen, head_dim)
        w[p + "attention.key_layernorm.weight"] = norm_weight(gen, head_dim)
        w[p + "attention.dense.weight"] = linear(gen, hidden, heads * head_dim)
        w[p + "post_attention_layernorm.weight"] = norm_weight(gen, hidden)
        if i < moe["dense_layers"]:
            w[p + "mlp.gate_proj.weight"] = linear(gen, intermediate, hidden)
            w[p + "mlp.up_proj.weight"] = linear(gen, intermediate, hidden)
            w[p + "mlp.down_proj.weight"] = linear(gen, hidden, intermediate)
            continue
        size = moe["moe_intermediate"]
        w[p + "mlp.gate.weight"] = linear(gen, moe["num_experts"], hidden)
        # Sigmoid scores sit near 0.5 +- 0.1 here: a bias of this spread reorders them.
        w[p + "mlp.gate.expert_bias"] = normal(gen, (moe["num_experts"],), 0.1)
        for e in range(moe["num_experts"]):
            w[p + f"mlp.experts.{e}.gate_proj.weight"] = linear(gen, size, hidden)
            w[p + f"mlp.experts.{e}.up_proj.weight"] = linear(gen, size, hidden)
            w[p + f"mlp.experts.{e}.down_proj.weight"] = linear(gen, hidden, size)
        shared = size * moe["shared_experts"]
        w[p + "mlp.shared_experts.gate_proj.weight"] = linear(gen, shared, hidden)
        w[p + "mlp.shared_experts.up_proj.weight"] = linear(gen, shared, hidden)
        w[p + "mlp.shared_experts.down_proj.weight"] = linear(gen, hidden, shared)
    w["model.norm.weight"] = norm_weight(gen, hidden)
    w["lm_head.weight"] = normal(gen, (vocab_size, hidden), 3.0 / hidden**0.5)
    return w


def write(out: pathlib.Path, gen, *, vocab: str, dtype: str, max_len: int, sizes: dict):
    """The folder's files but the weights; returns (config, generation config, weights)."""
    if vocab != "small":
        raise ValueError("llada2 tiny checkpoints have the small vocabulary only")
    vocab_table, merges = base_vocab(SMALL_LLADA2_SPECIALS[0][0])
    ids = write_tokenizer(out, vocab_table, merges, max_len)
    copy_config_module(out, "llada2.py", "configuration_llada2_moe.py")
    return (config(ids=ids, dtype=dtype, max_len=max_len, moe=DEFAULT_MOE, **sizes), generation_config(ids),
            weights(gen, vocab_size=ids["vocab_size"], moe=DEFAULT_MOE, **sizes))
