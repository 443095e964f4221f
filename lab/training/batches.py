"""Task instances as training rows: prompts through the model family's chat frame,
answer canvases (per-row lengths), per-task batch sizes, and `pack`, the right-padded
[B, L] batch of the LLaDA-format loop and its evaluation."""

from __future__ import annotations

import pathlib
import random

import torch

from lab.tasks import TRAIN, Task

CHAT_PREFIX = "<|startoftext|><|start_header_id|>user<|end_header_id|>\n\n"
CHAT_SUFFIX = "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"

# Sequences per batch, chosen so each task's batch is a similar number of tokens.
BATCH_SIZES = {"retrieval": 24, "addition": 96, "copy": 48, "reverse": 48,
               "sort": 48, "multiply": 96, "chain": 32, "brackets": 64, "lookup": 48, "recall": 48,
               "working_sum": 96, "padded_sum": 96}


class Encoder:
    def __init__(self, tokenizer_dir: pathlib.Path, ids: dict[str, int]):
        from transformers import PreTrainedTokenizerFast

        self.tok = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_dir / "tokenizer.json"))
        self.ids = ids

    def prompt(self, text: str) -> list[int]:
        return self.tok.encode(CHAT_PREFIX + text.strip() + CHAT_SUFFIX, add_special_tokens=False)

    def canvas(self, answer: str, gen_length: int) -> list[int]:
        tokens = self.tok.encode(answer, add_special_tokens=False) + [self.ids["eot"]]
        if len(tokens) > gen_length:
            raise ValueError(f"answer of {len(tokens)} tokens does not fit a canvas of {gen_length}")
        return tokens + [self.ids["eos"]] * (gen_length - len(tokens))

    def decode(self, tokens: list[int]) -> str:
        return self.tok.decode(tokens, skip_special_tokens=True)


class Llada2Encoder(Encoder):
    """Prompts through the checkpoint's own chat template (Ling's <role> frame), as the
    served model and `lab.eval` encode them; the canvas is the answer, then EOS
    to its end (LLaDA2 decoding stops at the first EOS)."""

    def __init__(self, tokenizer_dir: pathlib.Path, ids: dict[str, int]):
        from transformers import PreTrainedTokenizerFast

        self.tok = PreTrainedTokenizerFast.from_pretrained(str(tokenizer_dir))
        self.ids = ids

    def prompt(self, text: str) -> list[int]:
        chat = self.tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                            add_generation_prompt=True)
        return self.tok.encode(chat, add_special_tokens=False)

    def canvas(self, answer: str, gen_length: int) -> list[int]:
        tokens = self.tok.encode(answer, add_special_tokens=False)
        if len(tokens) + 1 > gen_length:
            raise ValueError(f"answer of {len(tokens)} tokens and EOS do not fit a canvas of {gen_length}")
        return tokens + [self.ids["eos"]] * (gen_length - len(tokens))


def canvas_length(answer_tokens: int, task: Task, max_canvas: int, own_share: float, rng: random.Random) -> int:
    """A row's canvas length: the task's own with probability `own_share`, else uniform
    from the answer's length (no room for <|eot_id|>: the canvas ends with the answer)
    up to `max_canvas`.  A real LLaDA fills whatever canvas a request asks for with
    end-of-text after its answer; a model trained at one length per task does not
    (without it, `add 9+3=` on the server's default 56-position canvas gave `NE`)."""
    if max_canvas <= 0 or rng.random() < own_share:
        return task.gen_length
    return rng.randint(answer_tokens, max(answer_tokens, max_canvas))


def make_batch(task: Task, encoder: Encoder, rng: random.Random, size: int, split: str = TRAIN,
               max_canvas: int = 0, own_share: float = 0.0):
    """Instances, prompt ids and canvases.  With `max_canvas` each row draws its own
    canvas length (see `canvas_length`); without, every canvas is `task.gen_length`."""
    instances = [task.sample(rng, split) for _ in range(size)]
    prompts = [encoder.prompt(i.prompt) for i in instances]
    canvases = []
    for inst in instances:
        answer = len(encoder.tok.encode(inst.answer, add_special_tokens=False))
        length = canvas_length(answer, task, max_canvas, own_share, rng)
        canvases.append(encoder.canvas(inst.answer, max(length, answer + 1))[:length])
    return instances, prompts, canvases


def pack(prompts: list[list[int]], canvases: list[list[int]], pad: int):
    """Right-padded [B, L] ids, per-row lengths and the canvas start of each row."""
    rows = [p + c for p, c in zip(prompts, canvases)]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
    lengths = torch.tensor([len(r) for r in rows])
    starts = torch.tensor([len(p) for p in prompts])
    return ids, lengths, starts
