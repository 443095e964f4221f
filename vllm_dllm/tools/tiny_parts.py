"""What every tiny checkpoint writer shares: the byte-level BPE vocabulary (256 byte
tokens, then merges learned from a small fixed corpus, then unreachable fillers),
seeded weight draws, and copying our configuration modules into a folder."""

from __future__ import annotations

import pathlib
from collections import Counter

from vllm_dllm.tools.hf_files import bytes_to_unicode

N_MERGES = 40
SMALL_VOCAB_SIZE = 320

CONFIGS_DIR = pathlib.Path(__file__).resolve().parent.parent / "configs"


def copy_config_module(out: pathlib.Path, source: str, target: str) -> None:
    """Our configuration class as the folder's own `configuration_*.py`."""
    (out / target).write_text((CONFIGS_DIR / source).read_text(encoding="utf-8"), encoding="utf-8")


_MERGE_CORPUS = (
    "hello world 123. The quick brown fox jumps over the lazy dog. "
    "The answer is 42, and the other answer is 7. In the beginning there was the word, "
    "and then there were the tokens. What is the sum of 12 and 30? The sum is 42. "
    "Please write a short story about a robot that learns to paint the world. "
    "The robot was happy. The world was hello. Then the end. "
    "Question: what is the capital of France? Answer: Paris is the capital of France. "
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n"
)


def train_merges(n_merges: int) -> list[tuple[str, str]]:
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


def base_vocab(n_total: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Byte tokens (id = byte value), then the merges, then unreachable
    fillers up to ``n_total`` entries."""
    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    merges = train_merges(N_MERGES)
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




def normal(gen, shape, std):
    import torch

    return torch.randn(shape, generator=gen, dtype=torch.float32) * std


def linear(gen, out_features, in_features):
    return normal(gen, (out_features, in_features), 1.0 / in_features**0.5)


def norm_weight(gen, n):
    return 1.0 + normal(gen, (n,), 0.02)
