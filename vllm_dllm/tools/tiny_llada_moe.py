"""Tiny random LLaDA-MoE checkpoints in the released file format (`make_tiny --arch llada-moe`).

Written: ``config.json`` (the released configuration class's keys, sizes replaced;
``model_type`` "llada" like LLaDA-8B, ``architectures`` ["LLaDAMoEModelLM"]),
``generation_config.json`` (the mask and EOS ids: the released config carries no mask
id), a copy of our ``configuration_lladamoe.py``, ``model.safetensors`` with the
released (OLMoE) tensor names (``model.embed_tokens``, ``model.layers.N.self_attn.
{q,k,v,o}_proj`` / ``q_norm`` / ``k_norm``, ``input_layernorm``,
``post_attention_layernorm``, a dense ``mlp.{gate,up,down}_proj`` where
``moe_layer_freq`` is 0, else ``mlp.gate``, ``mlp.expert_bias``,
``mlp.experts.E.{gate,up,down}_proj`` and the layer's ``shared_expert.*``;
``model.norm``, ``lm_head``) and the Ling-style tokenizer of the LLaDA2 tinies (the
release's tokenizer family; its ids differ from the release's 156892 / 156895).

Routing is made non-trivial on purpose: an expert bias large enough to change which
experts win and what they weigh, a shared expert, a dense first layer; QK-norm on
and a partial rotary factor, as released.
"""

from __future__ import annotations

import pathlib

from vllm_dllm.tools.tiny_llada2 import SMALL_LLADA2_SPECIALS, write_tokenizer
from vllm_dllm.tools.tiny_parts import base_vocab, copy_config_module, linear, norm_weight, normal

DEFAULT_MOE = dict(num_experts=8, experts_per_token=2, expert_intermediate=32, shared_intermediate=64,
                   dense_layers=1)


def config(*, ids, hidden, layers, heads, kv_heads, intermediate, dtype, max_len, moe) -> dict:
    return {
        "architectures": ["LLaDAMoEModelLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "auto_map": {
            "AutoConfig": "configuration_lladamoe.LLaDAConfig",
            "AutoModel": "modeling_lladamoe.LLaDAMoEModelLM",
        },
        "bos_token_id": None,
        "clip_qkv": None,
        "dense_intermediate_size": intermediate,
        "eos_token_id": ids["eos"],
        "expert_intermediate_size": moe["expert_intermediate"],
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "max_position_embeddings": max_len,
        "model_type": "llada",
        "moe_layer_freq": [0 if i < moe["dense_layers"] else 1 for i in range(layers)],
        "moe_router_enable_expert_bias": True,
        "moe_router_score_function": "softmax",
        "norm_topk_prob": False,
        "num_attention_heads": heads,
        "num_experts": moe["num_experts"],
        "num_experts_per_tok": moe["experts_per_token"],
        "num_hidden_layers": layers,
        "num_key_value_heads": kv_heads,
        "output_router_logits": False,
        "pad_token_id": ids["eos"],
        "partial_rotary_factor": 0.5,
        "qk_layernorm": True,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "rope_theta": 50000,
        "routed_scaling_factor": 1,
        "router_aux_loss_coef": 0.01,
        "router_num_group": None,
        "router_topk_group": None,
        "shared_expert_intermediate_size": moe["shared_intermediate"],
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "transformers_version": "4.46.2",
        "use_cache": False,
        "vocab_size": ids["vocab_size"],
    }


def generation_config(ids) -> dict:
    return {"eos_token_id": ids["eos"], "mask_token_id": ids["mask"], "pad_token_id": ids["eos"],
            "transformers_version": "4.46.2"}


def weights(gen, *, vocab_size, hidden, layers, heads, kv_heads, intermediate, moe):
    head_dim = hidden // heads
    w = {"model.embed_tokens.weight": normal(gen, (vocab_size, hidden), 0.02)}
    for i in range(layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm_weight(gen, hidden)
        w[p + "self_attn.q_proj.weight"] = linear(gen, heads * head_dim, hidden)
        w[p + "self_attn.k_proj.weight"] = linear(gen, kv_heads * head_dim, hidden)
        w[p + "self_attn.v_proj.weight"] = linear(gen, kv_heads * head_dim, hidden)
        w[p + "self_attn.q_norm.weight"] = norm_weight(gen, head_dim)
        w[p + "self_attn.k_norm.weight"] = norm_weight(gen, head_dim)
        w[p + "self_attn.o_proj.weight"] = linear(gen, hidden, heads * head_dim)
        w[p + "post_attention_layernorm.weight"] = norm_weight(gen, hidden)
        if i < moe["dense_layers"]:
            w[p + "mlp.gate_proj.weight"] = linear(gen, intermediate, hidden)
            w[p + "mlp.up_proj.weight"] = linear(gen, intermediate, hidden)
            w[p + "mlp.down_proj.weight"] = linear(gen, hidden, intermediate)
            continue
        size = moe["expert_intermediate"]
        w[p + "mlp.gate.weight"] = linear(gen, moe["num_experts"], hidden)
        # Softmax weights of 8 experts sit near 0.125 with a spread of the same order:
        # a bias of 0.1 both reorders the experts and changes what they weigh.
        w[p + "mlp.expert_bias"] = normal(gen, (moe["num_experts"],), 0.1)
        for e in range(moe["num_experts"]):
            w[p + f"mlp.experts.{e}.gate_proj.weight"] = linear(gen, size, hidden)
            w[p + f"mlp.experts.{e}.up_proj.weight"] = linear(gen, size, hidden)
            w[p + f"mlp.experts.{e}.down_proj.weight"] = linear(gen, hidden, size)
        shared = moe["shared_intermediate"]
        w[p + "shared_expert.gate_proj.weight"] = linear(gen, shared, hidden)
        w[p + "shared_expert.up_proj.weight"] = linear(gen, shared, hidden)
        w[p + "shared_expert.down_proj.weight"] = linear(gen, hidden, shared)
    w["model.norm.weight"] = norm_weight(gen, hidden)
    w["lm_head.weight"] = normal(gen, (vocab_size, hidden), 3.0 / hidden**0.5)
    return w


def write(out: pathlib.Path, gen, *, vocab: str, dtype: str, max_len: int, sizes: dict):
    """The folder's files but the weights; returns (config, generation config, weights)."""
    if vocab != "small":
        raise ValueError("llada-moe tiny checkpoints have the small vocabulary only")
    vocab_table, merges = base_vocab(SMALL_LLADA2_SPECIALS[0][0])
    ids = write_tokenizer(out, vocab_table, merges, max_len)
    copy_config_module(out, "llada_moe.py", "configuration_lladamoe.py")
    return (config(ids=ids, dtype=dtype, max_len=max_len, moe=DEFAULT_MOE, **sizes), generation_config(ids),
            weights(gen, vocab_size=ids["vocab_size"], moe=DEFAULT_MOE, **sizes))
