"""Writing the trained model as an unmodified LLaDA checkpoint folder.

The task tokenizer is byte-level BPE whose merges make every two-letter lowercase
pair one token, and ";xy=" one token (a retrieval key with its separators), so the
retrieval contexts stay short; digits and capitals stay single characters, one token
per digit for addition and per symbol for copy/reverse.
"""

from __future__ import annotations

import json
import pathlib
import string

import torch
from safetensors.torch import save_file

from vllm_dllm.tools.hf_files import (
    bytes_to_unicode,
    llada_special_ids,
    save_byte_level_bpe,
    write_json,
    write_llada_tokenizer_config,
)
from vllm_dllm.tools.tiny_llada import llada_config
from vllm_dllm.tools.tiny_parts import copy_config_module

SPECIALS = [
    "<|startoftext|>",
    "<|endoftext|>",
    "<|mdm_mask|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]


def _vocab_and_merges() -> tuple[dict[str, int], list[tuple[str, str]]]:
    byte = bytes_to_unicode()
    vocab = {ch: b for b, ch in byte.items()}
    merges: list[tuple[str, str]] = []
    letters = string.ascii_lowercase
    pairs = [a + b for a in letters for b in letters]
    for pair in pairs:
        merges.append((pair[0], pair[1]))
    for pair in pairs:
        merges.append((byte[ord(";")], pair))
    for pair in pairs:
        merges.append((byte[ord(";")] + pair, byte[ord("=")]))
    for a, b in merges:
        vocab[a + b] = len(vocab)
    return vocab, merges


def build_tokenizer(out: pathlib.Path, max_len: int) -> dict[str, int]:
    """Write tokenizer.json & co.; return the special ids and the vocabulary size."""
    vocab, merges = _vocab_and_merges()
    for content in SPECIALS:
        vocab[content] = len(vocab)
    # No regex split: merges may cross punctuation (";xy=" is one token).
    save_byte_level_bpe(out, vocab, merges, SPECIALS, use_regex=False)
    ids = {c: vocab[c] for c in SPECIALS}
    write_llada_tokenizer_config(out, [(ids[c], c) for c in SPECIALS], max_len)
    # Embedding rows are padded to a multiple of 64, like the real model's.
    return llada_special_ids(ids, -(-len(vocab) // 64) * 64)


def write_checkpoint(
    out: pathlib.Path,
    state_dict: dict[str, torch.Tensor],
    ids: dict[str, int],
    shape: dict[str, int],
    *,
    max_len: int,
    dtype: torch.dtype = torch.bfloat16,
    generation: dict | None = None,
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out, max_len)
    dtype_name = {torch.bfloat16: "bfloat16", torch.float32: "float32"}[dtype]
    config = llada_config(
        ids=ids,
        hidden=shape["hidden"],
        layers=shape["layers"],
        heads=shape["heads"],
        kv_heads=shape["heads"],
        intermediate=shape["intermediate"],
        dtype=dtype_name,
        max_len=max_len,
    )
    config["rope_theta"] = float(shape.get("rope_theta", config["rope_theta"]))
    # No auto_map: with one, transformers 5.x's AutoTokenizer (which loads the config
    # first) asks interactively whether to run configuration_llada.py.  The plugin
    # registers the LLaDA config class itself, so vLLM needs no remote code, and
    # AutoTokenizer falls back to the tokenizer_config's standard class.
    config.pop("auto_map", None)
    write_json(out / "config.json", config)
    copy_config_module(out, "llada.py", "configuration_llada.py")
    write_json(
        out / "generation_config.json",
        {
            "bos_token_id": ids["bos"],
            # The answer ends with <|eot_id|>, then EOS padding fills the canvas.
            "eos_token_id": [ids["eot"], ids["eos"]],
            **(generation or {}),
        },
    )
    tensors = {k: v.detach().to(dtype).contiguous() for k, v in state_dict.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)


def read_json(path: pathlib.Path) -> dict:
    return json.loads(path.read_text())
