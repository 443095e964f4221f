"""Write tiny random LLaDA / Dream checkpoints in the real HF file format.

Usage::

    python -m vllm_dllm.tools.make_tiny --arch llada|dream|llada2|llada-moe --out DIR \
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
* LLaDA-MoE (``llada-moe``, small vocabulary only): see vllm_dllm/tools/tiny_llada_moe.py.
* Dream: ``config.json`` (Qwen2 keys), ``generation_config.json``,
  ``configuration_dream.py``, ``model.safetensors`` (Qwen2 names incl. q/k/v
  biases), ``vocab.json`` + ``merges.txt`` + ``tokenization_dream.py`` +
  ``tokenizer_config.json`` (``DreamTokenizer``, Qwen2.5 chat template),
  ``special_tokens_map.json`` and ``added_tokens.json``.

One module per architecture writes its files (tiny_llada.py, tiny_dream.py,
tiny_llada2.py, tiny_llada_moe.py, sharing tiny_parts.py); this one checks the arguments, draws the
weights in order and saves them.

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
import pathlib
import sys

from vllm_dllm.tools import tiny_dream, tiny_llada, tiny_llada2, tiny_llada_moe
from vllm_dllm.tools.hf_files import write_json

FORMAT_VERSION = 1

# Each architecture's writer: the folder's files but the weights, then
# (config, generation config, weights).
WRITERS = {"llada": tiny_llada.write, "dream": tiny_dream.write, "llada2": tiny_llada2.write,
           "llada-moe": tiny_llada_moe.write}
# Architectures whose released models have no GQA: their tinies keep kv_heads = heads.
_NO_GQA = ("llada", "llada-moe")

_ALL_FILES = (
    "config.json",
    "generation_config.json",
    "configuration_llada.py",
    "configuration_dream.py",
    "configuration_llada2_moe.py",
    "configuration_lladamoe.py",
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

    ``kv_heads=None`` means: LLaDA and LLaDA-MoE -> ``heads`` (the real models have no GQA);
    Dream -> ``heads // 2`` when ``heads`` is even and > 1, else ``heads``
    (GQA like the real 28/4 model).
    """
    import torch
    from safetensors.torch import save_file

    arch = arch.lower()
    if arch not in WRITERS:
        raise ValueError(f"arch must be one of {', '.join(map(repr, WRITERS))}, got {arch!r}")
    if vocab not in ("small", "real"):
        raise ValueError(f"vocab must be 'small' or 'real', got {vocab!r}")
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(dtype)
    if torch_dtype is None:
        raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
    if kv_heads is None:
        kv_heads = heads // 2 if (arch not in _NO_GQA and heads > 1 and heads % 2 == 0) else heads
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
    config, gen_config, weights = WRITERS[arch](out, gen, vocab=vocab, dtype=dtype, max_len=max_len, sizes=sizes)

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
        description="Write a tiny random LLaDA/Dream/LLaDA2/LLaDA-MoE checkpoint in the real HF file format.",
    )
    ap.add_argument("--arch", required=True, choices=list(WRITERS))
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
