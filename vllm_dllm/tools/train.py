"""Train the small LLaDA-format model on the generated tasks.

    python -m vllm_dllm.tools.train --out runs/task-model --minutes 40

Masked-diffusion SFT as LLaDA does it: the prompt stays clean, a mask ratio t is drawn
per row over the canvas (answer, <|eot_id|>, EOS padding) and the loss is the
cross-entropy on masked positions weighted by 1/t (see `diffusion_loss`).  Task sizes
may follow a curriculum (vllm_dllm/training/curriculum.py).  Fixed seeds; every
`--save-every` steps the full state (model, optimizer, RNGs, curriculum) is saved so a
stopped run resumes with `--resume`.  Loss and held-out accuracy go to
OUT/train_log.jsonl; the final model is written to OUT/model as an unmodified LLaDA
checkpoint, and `--export DIR` writes one from the last saved state.

    python -m vllm_dllm.tools.train --arch llada2 --out runs/llada2 --tasks every

`--arch llada2` trains a LLaDA2.x-format model (`llada2_moe`: block-causal attention,
MoE with a shared expert and dense first layers, QK-norm, partial RoPE) with LLaDA2's
block-diffusion objective and LLaDA2.1's token editing (`--edit-ratio`), and writes an
unmodified LLaDA2 checkpoint (its loop: vllm_dllm/tools/train_llada2.py; model and
objective: vllm_dllm/training/llada2.py; the same curriculum, task weights, saving and
resuming).  Tasks: names, or `all` (the original four),
`hard` (sort, multiply, chain, brackets), `every` (both).
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import random
import time

import torch
import torch.nn.functional as F

from vllm_dllm.decoding.base import DecodeState, SpecialIds, make_rule
from vllm_dllm.options import LLADA, LLaDAOptions
from vllm_dllm.tasks import TEST, TRAIN, Task, resolve_tasks, score
from vllm_dllm.training.checkpoint import build_tokenizer, write_checkpoint
from vllm_dllm.training.curriculum import Curriculum, fitting_task
from vllm_dllm.training.model import TrainableLLaDA

CHAT_PREFIX = "<|startoftext|><|start_header_id|>user<|end_header_id|>\n\n"
CHAT_SUFFIX = "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"

# Sequences per batch, chosen so each task's batch is a similar number of tokens.
BATCH_SIZES = {"retrieval": 24, "addition": 96, "copy": 48, "reverse": 48,
               "sort": 48, "multiply": 96, "chain": 32, "brackets": 64, "lookup": 48, "recall": 48}


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
    served model and `vllm_dllm.eval` encode them; the canvas is the answer, then EOS
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
    (issue 15: `add 9+3=` on the server's default 56-position canvas gave `NE`)."""
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


def diffusion_loss(model, ids, lengths, starts, gen_length, mask_id: int, gen: torch.Generator,
                   pad_id: int | None = None) -> tuple[torch.Tensor, float | None]:
    """LLaDA's masked-diffusion SFT loss, in the estimator LLaDA itself uses for likelihoods.

    Each row masks exactly k ~ U{1..G} of its G canvas positions (mask ratio t = k/G,
    k stratified over the batch) and weights the cross-entropy of its masked positions
    by 1/t.  In expectation this is the 1/t-weighted loss with t ~ U(0, 1), but the
    weight never exceeds G: with t drawn continuously, rows with t near 0 carry weights
    of hundreds on a single token, and after gradient clipping one such row decides the
    whole step (the first training run stalled on exactly that).

    Returns the loss and the argmax accuracy on masked positions other than `pad_id`
    (the answer and its end-of-turn, not the EOS padding; None when none was masked).
    The end-of-turn counts: placing it is knowing the answer's length.

    `gen_length` is one canvas length for the batch or a [B] tensor of per-row lengths
    (each row's canvas ends at its own `lengths`).  The loss is the mean over rows of
    each row's 1/t-weighted sum divided by its canvas length, as in LLaDA's SFT.
    """
    b = ids.shape[0]
    g = torch.as_tensor(gen_length, dtype=torch.long).expand(b)
    g_max = int(g.max())
    strata = ((torch.arange(b) + torch.rand(b, generator=gen)) / b)[torch.randperm(b, generator=gen)]
    k = torch.minimum((strata * g).long(), g - 1) + 1
    keys = torch.rand(b, g_max, generator=gen)
    keys[torch.arange(g_max)[None] >= g[:, None]] = 2.0  # beyond a row's canvas: never masked
    order = keys.argsort(1).argsort(1)
    masked = order < k[:, None]
    canvas_pos = starts[:, None] + torch.arange(g_max)[None]  # [B, G]
    rows = torch.arange(b)[:, None].expand_as(canvas_pos)
    row_m, pos_m = rows[masked], canvas_pos[masked]
    noisy = ids.clone()
    noisy[row_m, pos_m] = mask_id
    device = next(model.parameters()).device
    hidden = model.hidden_states(noisy.to(device), lengths.to(device))
    # Logits only where the loss is taken: the prompt never needs them.
    picked = model.logits(hidden[row_m.to(device), pos_m.to(device)]).float()
    target = ids[row_m, pos_m].to(device)
    ce = F.cross_entropy(picked, target, reduction="none")
    # Weight G/k on each masked token, over G positions per row: 1/k.
    weights = (1.0 / k.float())[row_m].to(device)
    answer = target != pad_id if pad_id is not None else torch.ones_like(target, dtype=torch.bool)
    with torch.no_grad():
        hits = (picked.argmax(-1) == target)[answer]
        accuracy = hits.float().mean().item() if hits.numel() else None
    return (ce * weights).sum() / b, accuracy


@torch.no_grad()
def evaluate(model, task: Task, encoder: Encoder, n: int, seed: int, gen_length: int | None = None) -> float:
    """Exact decoding (steps = canvas length, one block, low confidence) on the test split,
    at the task's own canvas length or `gen_length`."""
    rng = random.Random(seed)
    ids = encoder.ids
    special = SpecialIds(mask=ids["mask"], eos=ids["eos"], eot=ids["eot"])
    gen_length = gen_length or task.gen_length
    options = LLaDAOptions(
        gen_length=gen_length, steps=gen_length, block_length=gen_length,
        remasking="low_confidence", temperature=0.0, cfg_scale=0.0,
        logits_eos_inf=False, confidence_eos_eot_inf=False,
    )
    instances = [task.sample(rng, TEST) for _ in range(n)]
    prompts = [encoder.prompt(i.prompt) for i in instances]
    state = DecodeState(n, options.gen_length, special, torch.device("cpu"))
    rule = make_rule(LLADA, state)
    for slot in range(n):
        state.admit(slot, options, seed=0)
        rule.admit(slot, options)
    slots = torch.arange(n)
    device = next(model.parameters()).device
    for _ in range(options.steps):
        batch, lengths, starts = pack(prompts, state.canvas.tolist(), ids["eos"])
        logits = model(batch.to(device), lengths.to(device)).float().cpu()
        rule.denoise(
            slots, slots, options.gen_length,
            lambda rows, positions: rule.reduce(logits[rows, starts[rows] + positions].clone(), slots[rows], positions),
        )
    correct = 0
    for inst, out in zip(instances, state.canvas.tolist()):
        cut = [i for i, tok in enumerate(out) if tok in (ids["eot"], ids["eos"])]
        correct += score(inst, encoder.decode(out[: cut[0]] if cut else out))
    return correct / n


def save_state(path: pathlib.Path, model, optim, data_rng, noise, step: int, args, curriculum: Curriculum,
               **extra) -> None:
    state = {
        "model": model.state_dict(), "optim": optim.state_dict(), "data_rng": data_rng.getstate(),
        "curriculum": curriculum.state_dict(),
        "noise": noise.get_state(), "step": step, "args": {k: str(v) for k, v in vars(args).items()},
        **extra,
    }
    save_atomically(state, path)


def save_atomically(obj, path: pathlib.Path) -> None:
    """A file that is whole or absent: a run stopped mid-write keeps the last one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(obj, path.with_suffix(".tmp"))
    path.with_suffix(".tmp").replace(path)


def load_state(path: pathlib.Path) -> dict:
    """A saved training state with every tensor on the CPU, whatever device trains: the
    random streams' states must be CPU byte tensors (a CUDA run's resume failed on a state
    mapped onto the GPU), and `load_state_dict` copies weights and moments to the model's
    own device."""
    return torch.load(path, weights_only=False, map_location="cpu")


def export_weights(state_path: pathlib.Path, out: pathlib.Path) -> int:
    """What `init_from` reads of a saved state, alone: the optimizer's moments and the
    random streams are two thirds of a state and mean nothing to a new run."""
    state = load_state(state_path)
    save_atomically({k: state[k] for k in ("model", "curriculum", "step", "args") if k in state}, out)
    return state["step"]


def parse_task_values(text: str, names: list[str], what: str) -> dict[str, int]:
    """`retrieval=4,addition=2` -> {"retrieval": 4, "addition": 2}; names must be trained tasks."""
    values: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep or name not in names:
            raise ValueError(f"{what}: '{item}' is not task=N for one of the trained tasks ({', '.join(names)})")
        try:
            values[name] = int(value)
        except ValueError:
            raise ValueError(f"{what}: '{value}' in '{item}' is not a whole number") from None
        if values[name] < 1:
            raise ValueError(f"{what}: '{item}' must be at least 1")
    return values


def parse_full_shares(text: str, names: list[str]) -> dict[str, float]:
    """`0.5` (every task) or `0.5,chain=1` (every task, then chain's own) -> a share
    per trained task."""
    shares = dict.fromkeys(names, 0.0)
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.rpartition("=")
        if sep and name not in names:
            raise ValueError(f"--full-size-share: '{item}' names no trained task ({', '.join(names)})")
        try:
            share = float(value)
        except ValueError:
            raise ValueError(f"--full-size-share: '{value}' in '{item}' is not a number") from None
        if sep:
            shares[name] = share
        else:
            shares = {n: share for n in names}
    return shares


def task_cycle(names: list[str], weights: dict[str, int]) -> list[str]:
    """The order tasks take steps in: each name `weights[name]` times (default once),
    interleaved so a heavily weighted task never runs long stretches alone."""
    counts = {n: weights.get(n, 1) for n in names}
    cycle: list[str] = []
    for round_ in range(max(counts.values())):
        cycle.extend(n for n in names if counts[n] > round_)
    return cycle


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def export(model, out: pathlib.Path, ids: dict, shape: dict, max_len: int, tasks: list[Task]) -> None:
    """An unmodified LLaDA checkpoint whose default canvas fits every task's answer."""
    cpu_weights = {k: v.cpu() for k, v in model.state_dict().items()}
    generation = {"max_new_tokens": max(t.gen_length for t in tasks)}
    write_checkpoint(out, cpu_weights, ids, shape, max_len=max_len, generation=generation)


def export_saved(state_path: pathlib.Path, out: pathlib.Path) -> int:
    """Write the checkpoint of a saved state, shaped by the saved run's own arguments
    (width, positions, context length, tasks), whatever the command line says."""
    state = load_state(state_path)
    saved = state["args"]
    if saved.get("arch", "llada") == "llada2":
        from vllm_dllm.tools.train_llada2 import export_saved_llada2  # it builds on this module

        return export_saved_llada2(state, state_path, out)
    shape = dict(hidden=int(saved["hidden"]), layers=int(saved["layers"]), heads=int(saved["heads"]),
                 intermediate=int(saved["intermediate"]), rope_theta=float(saved.get("rope_theta", 500000.0)))
    max_len = int(saved["max_len"])
    ids = build_tokenizer(state_path.parent / "tokenizer", max_len)
    model = TrainableLLaDA(ids["vocab_size"], shape["hidden"], shape["layers"], shape["heads"],
                           shape["intermediate"], theta=shape["rope_theta"])
    model.load_state_dict(state["model"])
    export(model, out, ids, shape, max_len, resolve_tasks(saved["tasks"]))
    return state["step"]


def make_curriculum(names: list[str], args, ap) -> Curriculum:
    try:
        shares = parse_full_shares(args.full_size_share, names)
    except ValueError as exc:
        ap.error(str(exc))
    try:
        return Curriculum(names, linear_steps=args.curriculum_steps, threshold=args.curriculum_threshold,
                          full_share=shares)
    except ValueError as exc:
        ap.error(f"--curriculum-steps/--curriculum-threshold/--full-size-share: {exc}")


# Beside an exported checkpoint's weights: the curriculum levels of the run that wrote
# it (vLLM ignores the file), so a run started from the folder keeps them.
CURRICULUM_FILE = "curriculum.json"


def init_from(state_path: pathlib.Path, model, curriculum: Curriculum, reshape=None) -> None:
    """Load another run's weights, and its task levels when both runs grow sizes
    adaptively (levels say what the model has learned, so they carry over).  A
    checkpoint folder (model.safetensors, e.g. the shipped vllm_dllm/default_model)
    gives its weights upcast to float32, and levels where it holds CURRICULUM_FILE.
    `reshape(weights, model's own state dict)`, when given, maps the source's weights
    onto the model's shape (training/grow.py deepens a LLaDA2 model)."""
    if state_path.is_dir():
        from safetensors.torch import load_file

        weights = {k: v.float() for k, v in load_file(str(state_path / "model.safetensors")).items()}
        levels_file = state_path / CURRICULUM_FILE
        saved = json.loads(levels_file.read_text()) if levels_file.exists() else None
    else:
        state = load_state(state_path)
        weights = state["model"]
        saved = state.get("curriculum")
    model.load_state_dict(weights if reshape is None else reshape(weights, model.state_dict()))
    # States saved before curricula recorded their settings came from adaptive runs.
    if saved and curriculum.threshold and (saved.get("settings") or {"threshold": 1}).get("threshold"):
        curriculum.levels.update({n: v for n, v in saved["levels"].items() if n in curriculum.levels})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=pathlib.Path)
    ap.add_argument("--steps", type=int, default=3000, help="schedule length (lr decays over it)")
    ap.add_argument("--minutes", type=float, default=None, help="stop early after this wall time")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--rope-theta", type=float, default=500000.0)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--embedding-std", type=float, default=None,
                    help="initial std of the token embeddings (default 0.02)")
    ap.add_argument("--batch-scale", type=float, default=1.0, help="multiply every task's batch size")
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--curriculum-steps", type=int, default=0,
                    help="grow task sizes from small to the full range over this many steps")
    ap.add_argument("--curriculum-threshold", type=float, default=0.0,
                    help="adaptive curriculum: raise a task's sizes a tenth of the way whenever its running "
                         "masked-answer accuracy passes this (e.g. 0.9)")
    ap.add_argument("--full-size-share", default="0",
                    help="draw this fraction of a task's batches at its full sizes while its curriculum level "
                         "is below them (those batches do not count toward the next level): one share, e.g. "
                         "0.5, or one with per-task ones after it, e.g. 0.5,chain=1")
    ap.add_argument("--tasks", default="retrieval,addition,copy,reverse",
                    help="task names, or all (the original four), hard (sort, multiply, chain, brackets), every")
    ap.add_argument("--task-weights", default="",
                    help="steps per task in each cycle, e.g. retrieval=4,addition=2 (others 1)")
    ap.add_argument("--batch-sizes", default="",
                    help="rows per batch for some tasks, e.g. retrieval=64 (others: built-in sizes "
                         "times --batch-scale)")
    ap.add_argument("--init-from", type=pathlib.Path, default=None,
                    help="start from the weights (and adaptive curriculum levels) of another run's "
                         "state.pt of the same shape; optimizer, schedule and data are new.  With --arch "
                         "llada2, a LLaDA-format checkpoint folder (e.g. vllm_dllm/default_model) is converted "
                         "into the LLaDA2 shape (training/convert_llada.py), every task from curriculum level 0")
    ap.add_argument("--max-canvas", type=int, default=0,
                    help="draw each row's canvas length from the answer's length up to this (0: every "
                         "task at its own gen_length)")
    ap.add_argument("--own-length-share", type=float, default=0.0,
                    help="with --max-canvas, the share of rows kept at the task's own canvas length")
    ap.add_argument("--eval-lengths", default="",
                    help="also evaluate at these canvas lengths, e.g. 8,56 (tasks whose answers do not fit "
                         "are skipped)")
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--eval-n", type=int, default=32)
    ap.add_argument("--save-every", type=int, default=100)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--device", default="cpu", help="e.g. cuda on a GPU machine")
    ap.add_argument("--export", type=pathlib.Path, default=None,
                    help="write the checkpoint of OUT/state.pt to this folder and exit (no training)")
    ap.add_argument("--export-weights", type=pathlib.Path, default=None,
                    help="write OUT/state.pt without its optimizer and random streams (weights, task levels, "
                         "step: a third of its size) to this file and exit; --init-from takes it, to carry a "
                         "run between machines")
    ap.add_argument("--arch", default="llada", choices=["llada", "llada2"],
                    help="llada: LLaDA-format model, masked diffusion; llada2: LLaDA2.x format (llada2_moe), "
                         "block diffusion with token editing")
    group = ap.add_argument_group("--arch llada2")
    group.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: --heads)")
    group.add_argument("--experts", type=int, default=16)
    group.add_argument("--experts-per-token", type=int, default=4)
    group.add_argument("--expert-groups", type=int, default=4, help="routing groups (n_group)")
    group.add_argument("--topk-groups", type=int, default=2, help="groups kept per token (topk_group)")
    group.add_argument("--moe-intermediate", type=int, default=128)
    group.add_argument("--shared-experts", type=int, default=1)
    group.add_argument("--dense-layers", type=int, default=1, help="first layers with a dense MLP")
    group.add_argument("--block-length", type=int, default=32, help="block diffusion block size (the decoder's)")
    group.add_argument("--edit-ratio", type=float, default=0.1,
                       help="LLaDA2.1 token editing: share of unmasked canvas tokens replaced by other tokens "
                            "(0: LLaDA2.0's objective alone)")
    group.add_argument("--edit-weight", type=float, default=1.0,
                       help="weight of the unmasked positions' loss (per canvas position)")
    group.add_argument("--qk-gain-init", type=float, default=1.0,
                       help="a new run's QK-norm gains (--resume and --init-from load theirs): with QK-norm a logit "
                            "is at most sqrt(head_dim) x g_q x g_k, so the gains are the attention's temperature")
    group.add_argument("--grow-depth", action="store_true",
                       help="with --init-from, the source may have fewer layers: they keep their order spread "
                            "over --layers, and the new layers start as the identity (zero output projections), "
                            "so the deeper model begins computing what the source did (training/grow.py)")
    group.add_argument("--mimetic-qk", type=float, default=None, metavar="NOISE",
                       help="a new run's query projections start as their key projections plus NOISE x a fresh "
                            "draw (mimetic initialisation: attention matches like tokens from the start)")
    group.add_argument("--balance-tasks", action="store_true",
                       help="rescale each step's gradients so every task's typical gradient norm is the same "
                            "(training/task_balance.py): tasks with short answers otherwise learn slowly under "
                            "one AdamW")
    group.add_argument("--bias-update", type=float, default=1e-3,
                       help="auxiliary-loss-free balancing: expert bias step after each optimizer step")
    group.add_argument("--eval-threshold", type=float, default=0.95, help="LLaDA2.0 threshold of the held-out eval")
    group.add_argument("--checkpoint-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                       help="dtype of the written checkpoint's weights")
    args = ap.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    # The held-out evaluation imports the decoding rule lazily; import it now so a
    # broken tree fails here rather than at the first evaluation, an hour in.
    import vllm_dllm.decoding.llada  # noqa: F401
    exports = {"--export": (args.export, export_saved, "{out} from step {step}"),
               "--export-weights": (args.export_weights, export_weights, "{out} (weights and task levels of step {step})")}
    for flag, (out, write, said) in exports.items():
        if out is not None:
            state_path = args.out / "state.pt"
            if not state_path.exists():
                ap.error(f"{flag} needs a saved state at {state_path}")
            print("wrote " + said.format(out=out, step=write(state_path, out)), flush=True)
            return 0
    if args.arch == "llada2":
        from vllm_dllm.tools.train_llada2 import train_llada2  # it builds on this module

        return train_llada2(args, ap)
    if args.balance_tasks:
        ap.error("--balance-tasks is an --arch llada2 option (the LLaDA-format loop keeps its published recipe)")
    if args.grow_depth:
        ap.error("--grow-depth is an --arch llada2 option")
    args.out.mkdir(parents=True, exist_ok=True)
    tok_dir = args.out / "tokenizer"
    tok_dir.mkdir(exist_ok=True)
    ids = build_tokenizer(tok_dir, args.max_len)
    encoder = Encoder(tok_dir, ids)
    try:
        tasks = resolve_tasks(args.tasks)
    except ValueError as exc:
        ap.error(f"--tasks: {exc}")
    names = [t.name for t in tasks]
    try:
        cycle = task_cycle(names, parse_task_values(args.task_weights, names, "--task-weights"))
        batch_sizes = {n: max(2, round(BATCH_SIZES[n] * args.batch_scale)) for n in names}
        batch_sizes.update(parse_task_values(args.batch_sizes, names, "--batch-sizes"))
        if min(batch_sizes.values()) < 2:
            raise ValueError("every batch needs at least two rows: mask ratios are stratified over the batch")
    except ValueError as exc:
        ap.error(str(exc))
    if args.init_from is not None and args.resume:
        ap.error("--init-from starts a new run; --resume continues this one: choose one")
    shape = dict(hidden=args.hidden, layers=args.layers, heads=args.heads, intermediate=args.intermediate,
                 rope_theta=args.rope_theta)
    try:
        eval_lengths = [int(x) for x in args.eval_lengths.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--eval-lengths: '{args.eval_lengths}' is not a comma-separated list of lengths")

    torch.manual_seed(args.seed)
    model = TrainableLLaDA(ids["vocab_size"], args.hidden, args.layers, args.heads, args.intermediate,
                           theta=args.rope_theta).to(args.device)
    if args.embedding_std is not None:
        torch.nn.init.normal_(model.model.transformer.wte.weight, std=args.embedding_std)
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    data_rng = random.Random(args.seed)
    noise = torch.Generator().manual_seed(args.seed)
    curriculum = make_curriculum(names, args, ap)
    step = 0
    state_path = args.out / "state.pt"
    if args.init_from is not None:
        try:
            init_from(args.init_from, model, curriculum)
        except (OSError, KeyError, ValueError, RuntimeError) as exc:
            ap.error(f"--init-from {args.init_from}: not a saved training state of this shape ({exc!r})")
        print(f"initialised from {args.init_from}", flush=True)
    if args.resume and state_path.exists():
        state = load_state(state_path)
        model.load_state_dict(state["model"])
        optim.load_state_dict(state["optim"])
        data_rng.setstate(state["data_rng"])
        noise.set_state(state["noise"])
        if "curriculum" in state:
            try:
                curriculum.load_state_dict(state["curriculum"])
            except ValueError as exc:
                ap.error(f"--resume: {exc}")
        step = state["step"]
        print(f"resumed at step {step}", flush=True)
    params = sum(p.numel() for p in model.parameters())
    log = (args.out / "train_log.jsonl").open("a")
    print(f"{params / 1e6:.2f}M parameters; vocab {ids['vocab_size']}", flush=True)

    start = time.time()
    model.train()
    while step < args.steps:
        if args.minutes is not None and time.time() - start > args.minutes * 60:
            break
        task, at_level = curriculum.draw(cycle[step % len(cycle)], step, data_rng)
        _, prompts, canvases = make_batch(task, encoder, data_rng, batch_sizes[task.name],
                                          max_canvas=args.max_canvas, own_share=args.own_length_share)
        batch, lengths, starts = pack(prompts, canvases, ids["eos"])
        gen_lengths = torch.tensor([len(c) for c in canvases])
        for group in optim.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        # float32 throughout: on this CPU bf16 autocast measured slower (1.9 vs 1.4 s
        # per retrieval batch).
        loss, answer_accuracy = diffusion_loss(
            model, batch, lengths, starts, gen_lengths, ids["mask"], noise, pad_id=ids["eos"]
        )
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        step += 1
        record = {"step": step, "task": task.name, "loss": round(loss.item(), 4),
                  "answer_accuracy": None if answer_accuracy is None else round(answer_accuracy, 3),
                  "elapsed_s": round(time.time() - start, 1)}
        record.update(curriculum.after_batch(task.name, at_level, answer_accuracy))
        if step % args.eval_every == 0 or step == args.steps:
            model.eval()
            record["accuracy"] = {t.name: evaluate(model, t, encoder, args.eval_n, seed=1) for t in tasks}
            for length in eval_lengths:
                fits = {t.name: fitting_task(t, length) for t in tasks}
                record[f"accuracy_at_{length}"] = {
                    name: evaluate(model, t, encoder, args.eval_n, seed=1, gen_length=length)
                    for name, t in fits.items() if t is not None
                }
            if any(curriculum.level(t.name, step) < 1.0 for t in tasks):
                # Progress on the sizes being trained, before the full range is reached.
                record["accuracy_at_curriculum_sizes"] = {
                    t.name: evaluate(model, curriculum.task(t.name, step), encoder, args.eval_n, seed=1)
                    for t in tasks
                }
            model.train()
        log.write(json.dumps(record) + "\n")
        log.flush()
        if step % 20 == 0 or "accuracy" in record or "level" in record:
            print(json.dumps(record), flush=True)
        if step % args.save_every == 0:
            save_state(state_path, model, optim, data_rng, noise, step, args, curriculum)
    save_state(state_path, model, optim, data_rng, noise, step, args, curriculum)
    export(model, args.out / "model", ids, shape, args.max_len, tasks)
    print(f"wrote {args.out / 'model'} after {step} steps", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
