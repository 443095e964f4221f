"""Tokenizer class for Dream checkpoints (``tokenizer_class: "DreamTokenizer"``).

Dream ships a Qwen2 byte-level BPE tokenizer as ``vocab.json`` + ``merges.txt``
(no ``tokenizer.json``) under the class name ``DreamTokenizer``. The tokenizer
itself is exactly transformers' ``Qwen2Tokenizer``; what differs are the
special tokens declared in ``tokenizer_config.json``: ``bos_token``
``<|beginoftext|>`` and ``mask_token`` ``<|mask|>`` next to the usual
``<|endoftext|>`` (eos = pad = unk). This subclass only supplies those defaults
when a tokenizer_config.json leaves them out, so ``bos_token_id`` and
``mask_token_id`` resolve.

Works with transformers 4.x (slow ``Qwen2Tokenizer(vocab_file, merges_file)``)
and 5.x (``Qwen2Tokenizer(vocab, merges)`` on the ``tokenizers`` backend); the
constructor forwards everything unchanged.

This module is self-contained on purpose: it imports only ``transformers``,
because its source is also written into checkpoint folders as
``tokenization_dream.py`` (``auto_map`` / ``trust_remote_code``).
"""

from transformers import Qwen2Tokenizer

__all__ = ["DreamTokenizer"]

DREAM_BOS_TOKEN = "<|beginoftext|>"
DREAM_MASK_TOKEN = "<|mask|>"


class DreamTokenizer(Qwen2Tokenizer):
    """Qwen2 byte-level BPE with Dream's bos (``<|beginoftext|>``) and mask
    (``<|mask|>``) special tokens."""

    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, *args, bos_token=DREAM_BOS_TOKEN, mask_token=DREAM_MASK_TOKEN, **kwargs):
        super().__init__(*args, bos_token=bos_token, mask_token=mask_token, **kwargs)
