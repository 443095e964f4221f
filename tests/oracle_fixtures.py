"""The oracle's self-checks' shared pieces: tiny random checkpoints written in the real
file layout (config.json + model.safetensors), the fixtures that load them, fake
models, and short calls of the reference loops."""

from __future__ import annotations

import json
import os
import sys

import math
import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from oracle import llada_generate  # noqa: E402
from oracle_dream import dream_generate  # noqa: E402
from oracle_model import load_oracle  # noqa: E402

VOCAB = 300
MASK, EOS, EOT = 257, 258, 259
HIDDEN, MLP = 64, 128


# --------------------------------------------------------------------------------------
# Tiny checkpoints
# --------------------------------------------------------------------------------------


def _linear(gen, out_f, in_f, std=None):
    std = 1.0 / math.sqrt(in_f) if std is None else std
    return torch.randn(out_f, in_f, generator=gen) * std


def _norm(gen, n):
    return 1.0 + 0.1 * torch.randn(n, generator=gen)


def write_llada(path, seed=0, n_heads=2, n_layers=2):
    gen = torch.Generator().manual_seed(seed)
    config = {
        "architectures": ["LLaDAModelLM"],
        "model_type": "llada",
        "d_model": HIDDEN,
        "n_heads": n_heads,
        "n_kv_heads": None,
        "n_layers": n_layers,
        "mlp_hidden_size": MLP,
        "mlp_ratio": 4,
        "vocab_size": VOCAB,
        "embedding_size": VOCAB,
        "activation_type": "silu",
        "block_type": "llama",
        "block_group_size": 1,
        "layer_norm_type": "rms",
        "rms_norm_eps": 1e-5,
        "layer_norm_with_affine": True,
        "bias_for_layer_norm": False,
        "rope": True,
        "rope_theta": 500000.0,
        "rope_full_precision": True,
        "alibi": False,
        "max_sequence_length": 4096,
        "include_bias": False,
        "include_qkv_bias": False,
        "attention_layer_norm": False,
        "input_emb_norm": False,
        "scale_logits": False,
        "weight_tying": False,
        "flash_attention": False,
        "multi_query_attention": None,
        "mask_token_id": MASK,
        "eos_token_id": EOS,
        "pad_token_id": EOS,
        "use_cache": False,
    }
    p = "model.transformer."
    state = {
        p + "wte.weight": torch.randn(VOCAB, HIDDEN, generator=gen) * 0.02,
        p + "ln_f.weight": _norm(gen, HIDDEN),
        p + "ff_out.weight": _linear(gen, VOCAB, HIDDEN, std=3.0 / math.sqrt(HIDDEN)),
    }
    for i in range(n_layers):
        b = f"{p}blocks.{i}."
        state[b + "attn_norm.weight"] = _norm(gen, HIDDEN)
        state[b + "ff_norm.weight"] = _norm(gen, HIDDEN)
        for name in ("q_proj", "k_proj", "v_proj", "attn_out"):
            state[b + name + ".weight"] = _linear(gen, HIDDEN, HIDDEN)
        state[b + "ff_proj.weight"] = _linear(gen, MLP, HIDDEN)
        state[b + "up_proj.weight"] = _linear(gen, MLP, HIDDEN)
        state[b + "ff_out.weight"] = _linear(gen, HIDDEN, MLP)
    _write(path, config, state)
    return path


def write_dream(path, seed=0, n_heads=4, n_kv_heads=2, n_layers=2, state_override=None):
    gen = torch.Generator().manual_seed(seed)
    hd = HIDDEN // n_heads
    config = {
        "architectures": ["DreamModel"],
        "model_type": "Dream",
        "hidden_size": HIDDEN,
        "intermediate_size": MLP,
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "max_position_embeddings": 2048,
        "hidden_act": "silu",
        "vocab_size": VOCAB,
        "tie_word_embeddings": False,
        "sliding_window": None,
        "use_sliding_window": False,
        "mask_token_id": MASK,
        "bos_token_id": EOS,
        "eos_token_id": EOS,
        "pad_token_id": EOS,
    }
    state = {
        "model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=gen) * 0.02,
        "model.norm.weight": _norm(gen, HIDDEN),
        "lm_head.weight": _linear(gen, VOCAB, HIDDEN, std=3.0 / math.sqrt(HIDDEN)),
    }
    for i in range(n_layers):
        b = f"model.layers.{i}."
        state[b + "input_layernorm.weight"] = _norm(gen, HIDDEN)
        state[b + "post_attention_layernorm.weight"] = _norm(gen, HIDDEN)
        for name, rows in (("q_proj", n_heads * hd), ("k_proj", n_kv_heads * hd), ("v_proj", n_kv_heads * hd)):
            state[b + f"self_attn.{name}.weight"] = _linear(gen, rows, HIDDEN)
            state[b + f"self_attn.{name}.bias"] = 0.1 * torch.randn(rows, generator=gen)
        state[b + "self_attn.o_proj.weight"] = _linear(gen, HIDDEN, n_heads * hd)
        state[b + "mlp.gate_proj.weight"] = _linear(gen, MLP, HIDDEN)
        state[b + "mlp.up_proj.weight"] = _linear(gen, MLP, HIDDEN)
        state[b + "mlp.down_proj.weight"] = _linear(gen, HIDDEN, MLP)
    if state_override is not None:
        state = state_override
    _write(path, config, state)
    return path


def tiny_llada(tmp_path_factory, name="llada", **kw):
    return load_oracle(write_llada(str(tmp_path_factory.mktemp(name)), **kw))


def tiny_dream(tmp_path_factory, name="dream", **kw):
    return load_oracle(write_dream(str(tmp_path_factory.mktemp(name)), **kw))


def _write(path, config, state):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(path, "model.safetensors"))


PROMPT = [5, 17, 42, 99, 3, 250, 7, 11]


class Recorder:
    """Wraps a model and keeps a copy of every canvas it is asked to score."""

    def __init__(self, model):
        self.model = model
        self.inputs: list[torch.Tensor] = []

    def forward(self, ids):
        self.inputs.append(ids.clone())
        return self.model.forward(ids)


class FakeModel:
    """Logits chosen by a function of (batch row, position); ignores the tokens."""

    def __init__(self, fn):
        self.fn = fn

    def forward(self, ids):
        bsz, seq_len = ids.shape
        out = torch.zeros(bsz, seq_len, VOCAB)
        for b in range(bsz):
            for j in range(seq_len):
                out[b, j] = self.fn(b, j, ids[b])
        return out


def one_hot_logits(token, height=10.0):
    row = torch.zeros(VOCAB)
    row[token] = height
    return row


# --------------------------------------------------------------------------------------

def _llada(model, **kw):
    args = dict(gen_length=16, steps=16, block_length=16, mask_id=MASK, eos_id=EOS, eot_id=EOT)
    args.update(kw)
    return llada_generate(model, PROMPT, **args)


def _expected_schedule(block_masks, steps):
    # Recomputed independently: m // steps each, the first m % steps get one more.
    return [block_masks // steps + (1 if s < block_masks % steps else 0) for s in range(steps)]


def _dream(model, **kw):
    args = dict(max_new_tokens=16, steps=16, mask_id=MASK)
    args.update(kw)
    return dream_generate(model, PROMPT, **args)
