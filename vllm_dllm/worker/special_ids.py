"""Mask, EOS and end-of-turn ids, read from the checkpoint's config and tokenizer."""

from __future__ import annotations

from vllm_dllm.decoding.base import SpecialIds

# End-of-turn markers of the chat templates we know; absent ones are simply unused.
_EOT_TOKENS = ("<|eot_id|>", "<|im_end|>")


def _first_id(value):
    if isinstance(value, (list, tuple)):
        return value[0] if value else None
    return value


def special_ids(model_config) -> SpecialIds:
    hf = model_config.hf_config
    mask = getattr(hf, "mask_token_id", None)
    if mask is None:
        raise ValueError(f"{model_config.model}: config.json has no mask_token_id")
    eos = _first_id(getattr(hf, "eos_token_id", None))
    eot = None
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(
            model_config.tokenizer,
            trust_remote_code=model_config.trust_remote_code,
            revision=model_config.tokenizer_revision,
        )
    except Exception:  # no tokenizer (skip_tokenizer_init): ids from config only
        tokenizer = None
    if tokenizer is not None:
        if eos is None:
            eos = tokenizer.eos_token_id
        vocab = tokenizer.get_vocab()
        for token in _EOT_TOKENS:
            if token in vocab:
                eot = vocab[token]
                break
    if eos is None:
        raise ValueError(f"{model_config.model}: no EOS id in config.json or tokenizer")
    return SpecialIds(mask=int(mask), eos=int(eos), eot=eot)
