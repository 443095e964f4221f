"""Write tiny random LLaDA / Dream checkpoints in the real HF file format.

Usage::

    python -m vllm_dllm.tools.make_tiny --arch llada|dream --out DIR \
        [--vocab small|real] [--seed 0] [--hidden 128] [--layers 2] [--heads 2] \
        [--kv-heads N] [--intermediate 256] [--dtype float32|bfloat16] [--max-len 512]

or ``make_tiny(arch, out_dir, ...)`` from Python.

What is written (see MODEL_SPEC.md sections 1, 1b, 2, 5):

* LLaDA: ``config.json`` (every real key spelled out, sizes replaced),
  ``generation_config.json``, ``configuration_llada.py``, ``model.safetensors``
  (real tensor names: ``model.transformer.wte`` / ``blocks.N.*`` / ``ln_f`` /
  ``ff_out``), ``tokenizer.json`` + ``tokenizer_config.json`` (byte-level BPE,
  ``PreTrainedTokenizerFast``, the LLaDA chat template) and
  ``special_tokens_map.json``.
* LLaDA2.x (``llada2``, small vocabulary only): see vllm_dllm/tools/tiny_llada2.py.
* Dream: ``config.json`` (Qwen2 keys), ``generation_config.json``,
  ``configuration_dream.py``, ``model.safetensors`` (Qwen2 names incl. q/k/v
  biases), ``vocab.json`` + ``merges.txt`` + ``tokenization_dream.py`` +
  ``tokenizer_config.json`` (``DreamTokenizer``, Qwen2.5 chat template),
  ``special_tokens_map.json`` and ``added_tokens.json``.

Besides the HF files, ``make_tiny.json`` records the generator arguments
(handy to tell whether a cached folder is stale; HF loaders ignore it).

Only the configuration and tokenizer code is written (copies of
``vllm_dllm/configs/{llada,dream,dream_tokenizer}.py``). The HF *modeling*
files (``modeling_llada.py``, ``modeling_dream.py``, ``generation_utils.py``)
are NOT written: our tooling does not need them, and no fake ones are shipped.
To run the official HF reference code on these folders, copy the official
files in yourself.

Vocabulary variants:

* ``small``: a 320-row vocabulary (256 byte tokens, 40 BPE merges, then the
  specials) whose special ids differ from the real ones (see
  ``SMALL_LLADA_SPECIALS`` / ``SMALL_DREAM_SPECIALS``), to prove nothing is
  hard-coded.
* ``real``: the real ids and sizes (LLaDA: vocab 126464, added tokens at
  126080-126348, mask 126336, eot 126348; Dream: vocab.json with 151643
  entries, added tokens 151643-151666, mask 151666, vocab_size 152064). The
  ids between the merges and the added tokens are unreachable fillers.

Weights are drawn from ``torch.Generator().manual_seed(seed)`` in a fixed
order: embeddings N(0, 0.02^2), LM head N(0, 9/fan_in) (peaked output
distributions, like a trained model's), other linears N(0, 1/fan_in), norm
weights 1 + N(0, 0.02^2), Dream q/k/v biases N(0, 0.02^2). Same arguments give
byte-identical folders.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from collections import Counter

from vllm_dllm.tools import tiny_llada2
from vllm_dllm.tools.hf_files import (
    DREAM_CHAT_TEMPLATE,
    added_token_entry,
    bytes_to_unicode,
    llada_special_ids,
    save_byte_level_bpe,
    write_json,
    write_llada_tokenizer_config,
)

FORMAT_VERSION = 1

_CONFIGS_DIR = pathlib.Path(__file__).resolve().parent.parent / "configs"

# ---------------------------------------------------------------------------
# Special tokens
# ---------------------------------------------------------------------------

N_MERGES = 40
SMALL_VOCAB_SIZE = 320

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

# (id, content) for the small Dream vocab: vocab.json holds ids 0..295, the
# added tokens follow contiguously (tokenizers appends added tokens in order).
SMALL_DREAM_SPECIALS = [
    (296, "<|endoftext|>"),  # eos = pad = unk; also config bos_token_id
    (297, "<|im_start|>"),
    (298, "<|im_end|>"),
    (299, "<|mask|>"),  # mask
    (300, "<|beginoftext|>"),  # tokenizer bos
]

REAL_LLADA_VOCAB_SIZE = 126464
REAL_DREAM_VOCAB_SIZE = 152064
_REAL_LLADA_FIRST_ADDED = 126080
_REAL_DREAM_FIRST_ADDED = 151643


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


# ---------------------------------------------------------------------------
# Chat templates
# ---------------------------------------------------------------------------

# LLaDA: bos before the first message; every message is
# <|start_header_id|>{role}<|end_header_id|>\n\n{content|trim}<|eot_id|>;
# the assistant header is ALWAYS appended (add_generation_prompt is ignored).
# ---------------------------------------------------------------------------
# Byte-level BPE vocabulary
# ---------------------------------------------------------------------------

_MERGE_CORPUS = (
    "hello world 123. The quick brown fox jumps over the lazy dog. "
    "The answer is 42, and the other answer is 7. In the beginning there was the word, "
    "and then there were the tokens. What is the sum of 12 and 30? The sum is 42. "
    "Please write a short story about a robot that learns to paint the world. "
    "The robot was happy. The world was hello. Then the end. "
    "Question: what is the capital of France? Answer: Paris is the capital of France. "
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n"
)


def _train_merges(n_merges: int) -> list[tuple[str, str]]:
    """Deterministic greedy BPE training on a fixed corpus (ties -> smallest pair)."""
    from tokenizers import pre_tokenizers

    pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    words = Counter(piece for piece, _ in pre.pre_tokenize_str(_MERGE_CORPUS))
    splits = {w: list(w) for w in words}
    merges: list[tuple[str, str]] = []
    while len(merges) < n_merges:
        pairs: Counter = Counter()
        for w, syms in splits.items():
            for a, b in zip(syms, syms[1:]):
                pairs[(a, b)] += words[w]
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        merged = best[0] + best[1]
        for w, syms in splits.items():
            out, i = [], 0
            while i < len(syms):
                if i + 1 < len(syms) and (syms[i], syms[i + 1]) == best:
                    out.append(merged)
                    i += 2
                else:
                    out.append(syms[i])
                    i += 1
            splits[w] = out
    if len(merges) != n_merges:
        raise RuntimeError("merge corpus too small")
    return merges


def _base_vocab(n_total: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Byte tokens (id = byte value), then the merges, then unreachable
    fillers up to ``n_total`` entries."""
    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    merges = _train_merges(N_MERGES)
    for a, b in merges:
        tok = a + b
        if tok in vocab:
            raise RuntimeError(f"duplicate merge token {tok!r}")
        vocab[tok] = len(vocab)
    k = 0
    while len(vocab) < n_total:
        vocab[f"<|filler_{k}|>"] = len(vocab)
        k += 1
    if len(vocab) != n_total:
        raise ValueError(f"base vocab needs at least {len(vocab)} entries, got {n_total}")
    return vocab, merges


SMALL_LLADA2_SPECIALS = tiny_llada2.SMALL_LLADA2_SPECIALS

# ---------------------------------------------------------------------------
# LLaDA
# ---------------------------------------------------------------------------


def _llada_tokenizer(out: pathlib.Path, vocab_variant: str, max_len: int) -> dict[str, int]:
    if vocab_variant == "small":
        specials, first_added, vocab_size = SMALL_LLADA_SPECIALS, 296, SMALL_VOCAB_SIZE
    else:
        specials, first_added, vocab_size = _real_llada_specials(), _REAL_LLADA_FIRST_ADDED, REAL_LLADA_VOCAB_SIZE
    vocab, merges = _base_vocab(first_added)
    # Specials live in the model vocab at their ids, so the added-token
    # entries of tokenizer.json keep exactly those ids.
    for tid, content in specials:
        assert tid == len(vocab)
        vocab[content] = tid

    save_byte_level_bpe(out, vocab, merges, [c for _, c in specials], use_regex=True)

    write_llada_tokenizer_config(out, specials, max_len)
    return llada_special_ids({c: t for t, c in specials}, vocab_size)


def _llada_config(*, ids, hidden, layers, heads, kv_heads, intermediate, dtype, max_len) -> dict:
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
    w[p + "wte.weight"] = _normal(gen, (vocab_size, hidden), 0.02)
    for i in range(layers):
        b = f"{p}blocks.{i}."
        w[b + "attn_norm.weight"] = _norm_weight(gen, hidden)
        w[b + "q_proj.weight"] = _linear(gen, heads * head_dim, hidden)
        w[b + "k_proj.weight"] = _linear(gen, kv_heads * head_dim, hidden)
        w[b + "v_proj.weight"] = _linear(gen, kv_heads * head_dim, hidden)
        w[b + "attn_out.weight"] = _linear(gen, hidden, heads * head_dim)
        w[b + "ff_norm.weight"] = _norm_weight(gen, hidden)
        w[b + "ff_proj.weight"] = _linear(gen, intermediate, hidden)  # gate
        w[b + "up_proj.weight"] = _linear(gen, intermediate, hidden)
        w[b + "ff_out.weight"] = _linear(gen, hidden, intermediate)  # down
    w[p + "ln_f.weight"] = _norm_weight(gen, hidden)
    w[p + "ff_out.weight"] = _normal(gen, (vocab_size, hidden), 3.0 / hidden**0.5)  # LM head
    return w


# ---------------------------------------------------------------------------
# Dream
# ---------------------------------------------------------------------------


def _dream_tokenizer(out: pathlib.Path, vocab_variant: str, max_len: int) -> dict[str, int]:
    if vocab_variant == "small":
        specials, first_added, vocab_size = SMALL_DREAM_SPECIALS, 296, SMALL_VOCAB_SIZE
    else:
        specials, first_added, vocab_size = _real_dream_specials(), _REAL_DREAM_FIRST_ADDED, REAL_DREAM_VOCAB_SIZE
    vocab, merges = _base_vocab(first_added)
    for i, (tid, _) in enumerate(specials):
        assert tid == first_added + i

    (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (out / "merges.txt").write_text(
        "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8"
    )
    write_json(out / "added_tokens.json", {c: t for t, c in specials})
    (out / "tokenization_dream.py").write_text(
        (_CONFIGS_DIR / "dream_tokenizer.py").read_text(encoding="utf-8"), encoding="utf-8"
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
    w["model.embed_tokens.weight"] = _normal(gen, (vocab_size, hidden), 0.02)
    for i in range(layers):
        b = f"model.layers.{i}."
        w[b + "input_layernorm.weight"] = _norm_weight(gen, hidden)
        w[b + "self_attn.q_proj.weight"] = _linear(gen, heads * head_dim, hidden)
        w[b + "self_attn.q_proj.bias"] = _normal(gen, (heads * head_dim,), 0.02)
        w[b + "self_attn.k_proj.weight"] = _linear(gen, kv_heads * head_dim, hidden)
        w[b + "self_attn.k_proj.bias"] = _normal(gen, (kv_heads * head_dim,), 0.02)
        w[b + "self_attn.v_proj.weight"] = _linear(gen, kv_heads * head_dim, hidden)
        w[b + "self_attn.v_proj.bias"] = _normal(gen, (kv_heads * head_dim,), 0.02)
        w[b + "self_attn.o_proj.weight"] = _linear(gen, hidden, heads * head_dim)
        w[b + "post_attention_layernorm.weight"] = _norm_weight(gen, hidden)
        w[b + "mlp.gate_proj.weight"] = _linear(gen, intermediate, hidden)
        w[b + "mlp.up_proj.weight"] = _linear(gen, intermediate, hidden)
        w[b + "mlp.down_proj.weight"] = _linear(gen, hidden, intermediate)
    w["model.norm.weight"] = _norm_weight(gen, hidden)
    w["lm_head.weight"] = _normal(gen, (vocab_size, hidden), 3.0 / hidden**0.5)
    return w


# ---------------------------------------------------------------------------
# Weight helpers
# ---------------------------------------------------------------------------


def _normal(gen, shape, std):
    import torch

    return torch.randn(shape, generator=gen, dtype=torch.float32) * std


def _linear(gen, out_features, in_features):
    return _normal(gen, (out_features, in_features), 1.0 / in_features**0.5)


def _norm_weight(gen, n):
    return 1.0 + _normal(gen, (n,), 0.02)


_ALL_FILES = (
    "config.json",
    "generation_config.json",
    "configuration_llada.py",
    "configuration_dream.py",
    "configuration_llada2_moe.py",
    "model.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenization_dream.py",
    "make_tiny.json",
)

# ---------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------


def make_tiny(
    arch: str,
    out_dir,
    *,
    vocab: str = "small",
    seed: int = 0,
    hidden: int = 128,
    layers: int = 2,
    heads: int = 2,
    kv_heads: int | None = None,
    intermediate: int = 256,
    dtype: str = "float32",
    max_len: int = 512,
) -> pathlib.Path:
    """Write a tiny random checkpoint folder and return its path.

    ``kv_heads=None`` means: LLaDA -> ``heads`` (the real model has no GQA);
    Dream -> ``heads // 2`` when ``heads`` is even and > 1, else ``heads``
    (GQA like the real 28/4 model).
    """
    import torch
    from safetensors.torch import save_file

    arch = arch.lower()
    if arch not in ("llada", "dream", "llada2"):
        raise ValueError(f"arch must be 'llada', 'dream' or 'llada2', got {arch!r}")
    if arch == "llada2" and vocab != "small":
        raise ValueError("llada2 tiny checkpoints have the small vocabulary only")
    if vocab not in ("small", "real"):
        raise ValueError(f"vocab must be 'small' or 'real', got {vocab!r}")
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(dtype)
    if torch_dtype is None:
        raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
    if kv_heads is None:
        kv_heads = heads // 2 if (arch != "llada" and heads > 1 and heads % 2 == 0) else heads
    if hidden % heads != 0:
        raise ValueError(f"hidden ({hidden}) must be divisible by heads ({heads})")
    if heads % kv_heads != 0:
        raise ValueError(f"heads ({heads}) must be divisible by kv_heads ({kv_heads})")
    if min(hidden, layers, heads, kv_heads, intermediate, max_len) <= 0:
        raise ValueError("sizes must be positive")

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name in _ALL_FILES:
        (out / name).unlink(missing_ok=True)

    sizes = dict(hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads, intermediate=intermediate)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    if arch == "llada":
        ids = _llada_tokenizer(out, vocab, max_len)
        config = _llada_config(ids=ids, dtype=dtype, max_len=max_len, **sizes)
        gen_config = {
            "_from_model_config": True,
            "bos_token_id": ids["bos"],
            "eos_token_id": ids["eos"],
            "transformers_version": "4.46.2",
        }
        (out / "configuration_llada.py").write_text(
            (_CONFIGS_DIR / "llada.py").read_text(encoding="utf-8"), encoding="utf-8"
        )
        weights = _llada_weights(gen, vocab_size=ids["vocab_size"], **sizes)
    elif arch == "llada2":
        vocab_table, merges = _base_vocab(SMALL_LLADA2_SPECIALS[0][0])
        ids = tiny_llada2.write_tokenizer(out, vocab_table, merges, max_len)
        config = tiny_llada2.config(ids=ids, dtype=dtype, max_len=max_len, moe=tiny_llada2.DEFAULT_MOE, **sizes)
        gen_config = tiny_llada2.generation_config(ids)
        (out / "configuration_llada2_moe.py").write_text(
            (_CONFIGS_DIR / "llada2.py").read_text(encoding="utf-8"), encoding="utf-8"
        )
        weights = tiny_llada2.weights(
            gen, vocab_size=ids["vocab_size"], moe=tiny_llada2.DEFAULT_MOE, normal=_normal, linear=_linear,
            norm_weight=_norm_weight, **sizes,
        )
    else:
        ids = _dream_tokenizer(out, vocab, max_len)
        config = _dream_config(ids=ids, dtype=dtype, max_len=max_len, **sizes)
        gen_config = _dream_generation_config(ids)
        (out / "configuration_dream.py").write_text(
            (_CONFIGS_DIR / "dream.py").read_text(encoding="utf-8"), encoding="utf-8"
        )
        weights = _dream_weights(gen, vocab_size=ids["vocab_size"], **sizes)

    write_json(out / "config.json", config)
    write_json(out / "generation_config.json", gen_config)
    weights = {k: v.to(torch_dtype).contiguous() for k, v in weights.items()}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)  # safetensors creates it 0600
    write_json(
        out / "make_tiny.json",
        {
            "format_version": FORMAT_VERSION,
            "arch": arch,
            "vocab": vocab,
            "seed": seed,
            "dtype": dtype,
            "max_len": max_len,
            **sizes,
        },
    )
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m vllm_dllm.tools.make_tiny",
        description="Write a tiny random LLaDA/Dream/LLaDA2 checkpoint in the real HF file format.",
    )
    ap.add_argument("--arch", required=True, choices=["llada", "dream", "llada2"])
    ap.add_argument("--out", required=True, help="output folder (created; our files are overwritten)")
    ap.add_argument("--vocab", default="small", choices=["small", "real"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--kv-heads", type=int, default=None)
    ap.add_argument("--intermediate", type=int, default=256)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--max-len", type=int, default=512)
    a = ap.parse_args(argv)
    out = make_tiny(
        a.arch,
        a.out,
        vocab=a.vocab,
        seed=a.seed,
        hidden=a.hidden,
        layers=a.layers,
        heads=a.heads,
        kv_heads=a.kv_heads,
        intermediate=a.intermediate,
        dtype=a.dtype,
        max_len=a.max_len,
    )
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
