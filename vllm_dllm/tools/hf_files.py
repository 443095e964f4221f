"""Writers for the Hugging Face files of LLaDA- and Dream-format checkpoints.

Shared by the tiny-checkpoint tool and the trained model's checkpoint writer.
"""

from __future__ import annotations

import json
import pathlib

LLADA_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if loop.first -%}{{ bos_token }}{%- endif -%}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + (message['content'] | trim) + '<|eot_id|>' }}"
    "{%- endfor -%}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
)

# Dream: Qwen2.5 layout, default system prompt "You are a helpful assistant."
# when the conversation has none, no bos, generation prompt on request.
DREAM_CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' -%}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if not (loop.first and message['role'] == 'system') -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def bytes_to_unicode() -> dict[int, str]:
    """The GPT-2 byte <-> printable-unicode table used by byte-level BPE."""
    keep = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("\xa1"), ord("\xac") + 1))
        + list(range(ord("\xae"), ord("\xff") + 1))
    )
    table = {}
    extra = 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def added_token_entry(content: str, special: bool = True) -> dict:
    return {
        "content": content,
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
        "special": special,
    }


def write_json(path: pathlib.Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False, sort_keys=False) + "\n", encoding="utf-8")


def save_byte_level_bpe(
    out: pathlib.Path, vocab: dict[str, int], merges: list[tuple[str, str]], specials: list[str], *, use_regex: bool
) -> None:
    """tokenizer.json of a byte-level BPE whose special tokens are already in `vocab`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=use_regex)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens(
        [AddedToken(c, special=True, normalized=False, lstrip=False, rstrip=False, single_word=False) for c in specials]
    )
    tok.save(str(out / "tokenizer.json"), pretty=True)


def write_llada_tokenizer_config(out: pathlib.Path, specials: list[tuple[int, str]], max_len: int) -> None:
    """tokenizer_config.json and special_tokens_map.json of a LLaDA tokenizer folder."""
    tokenizer_config = {
        "add_bos_token": False,
        "add_eos_token": False,
        "added_tokens_decoder": {str(tid): added_token_entry(c) for tid, c in specials},
        "bos_token": "<|startoftext|>",
        "chat_template": LLADA_CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|endoftext|>",
        "model_max_length": max_len,
        "pad_token": "<|endoftext|>",
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    write_json(out / "tokenizer_config.json", tokenizer_config)
    write_json(
        out / "special_tokens_map.json",
        {
            "bos_token": added_token_entry("<|startoftext|>"),
            "eos_token": added_token_entry("<|endoftext|>"),
            "pad_token": added_token_entry("<|endoftext|>"),
        },
    )


def llada_special_ids(token_ids: dict[str, int], vocab_size: int) -> dict[str, int]:
    """The ids a LLaDA checkpoint writer needs, by role."""
    return {
        "vocab_size": vocab_size,
        "bos": token_ids["<|startoftext|>"],
        "eos": token_ids["<|endoftext|>"],
        "mask": token_ids["<|mdm_mask|>"],
        "eot": token_ids["<|eot_id|>"],
    }
