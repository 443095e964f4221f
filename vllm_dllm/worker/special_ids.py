"""Mask, EOS and end-of-turn ids, read from the checkpoint's files.

Each id is looked up in config.json, then generation_config.json, then the
tokenizer's special tokens, then the family's release defaults (LLaDA2.x's config
carries no mask id; its generate() defaults name it).  The engine never hard-codes
an id: the tiny test checkpoints use others.
"""

from __future__ import annotations

from typing import Any

from vllm_dllm.decoding.base import SpecialIds
from vllm_dllm.options import RELEASE_SPECIAL_IDS

# End-of-turn markers of the chat templates we know; absent ones are simply unused.
_EOT_TOKENS = ("<|eot_id|>", "<|im_end|>")


def _first_id(value):
    if isinstance(value, (list, tuple)):
        return value[0] if value else None
    return value


def _generation_config(model_config) -> dict[str, Any]:
    from vllm.transformers_utils.repo_utils import get_hf_file_to_dict

    try:
        return dict(get_hf_file_to_dict("generation_config.json", model_config.model, model_config.revision) or {})
    except Exception:  # a missing or unreadable file holds no ids
        return {}


def _load_tokenizer(model_config):
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(
            model_config.tokenizer,
            trust_remote_code=model_config.trust_remote_code,
            revision=model_config.tokenizer_revision,
        )
    except Exception:  # no tokenizer (skip_tokenizer_init): ids from the files only
        return None


def special_ids(model_config, kind: str | None = None) -> SpecialIds:
    hf = model_config.hf_config
    generation = _generation_config(model_config)
    tokenizer = _load_tokenizer(model_config)
    release = RELEASE_SPECIAL_IDS.get(kind, {})

    def lookup(name: str, tokenizer_attr: str):
        for value in (getattr(hf, name, None), generation.get(name),
                      getattr(tokenizer, tokenizer_attr, None) if tokenizer is not None else None,
                      release.get(name)):
            value = _first_id(value)
            if value is not None:
                return int(value)
        return None

    mask = lookup("mask_token_id", "mask_token_id")
    if mask is None:
        raise ValueError(f"{model_config.model}: no mask_token_id in config.json, generation_config.json or tokenizer")
    eos = lookup("eos_token_id", "eos_token_id")
    if eos is None:
        raise ValueError(f"{model_config.model}: no EOS id in config.json, generation_config.json or tokenizer")
    eot = None
    if tokenizer is not None:
        vocab = tokenizer.get_vocab()
        eot = next((vocab[token] for token in _EOT_TOKENS if token in vocab), None)
    return SpecialIds(mask=mask, eos=eos, eot=eot)
