"""Train the small LLaDA-format model on the generated tasks.

    python -m lab.train --out runs/task-model --minutes 40

Masked-diffusion SFT as LLaDA does it: the prompt stays clean, a mask ratio t is drawn
per row over the canvas (answer, <|eot_id|>, EOS padding) and the loss is the
cross-entropy on masked positions weighted by 1/t (training/llada_objective.py).  Task
sizes may follow a curriculum (lab/training/curriculum.py).  Fixed seeds; every
`--save-every` steps the full state (model, optimizer, RNGs, curriculum) is saved so a
stopped run resumes with `--resume`.  Loss and held-out accuracy go to
OUT/train_log.jsonl; the final model is written to OUT/model as an unmodified LLaDA
checkpoint, and `--export DIR` writes one from the last saved state.

    python -m lab.train --arch llada2 --out runs/llada2 --tasks every

`--arch llada2` trains a LLaDA2.x-format model (`llada2_moe`: block-causal attention,
MoE with a shared expert and dense first layers, QK-norm, partial RoPE) with LLaDA2's
block-diffusion objective and LLaDA2.1's token editing (`--edit-ratio`), and writes an
unmodified LLaDA2 checkpoint (its loop: lab/train_llada2.py; model:
lab/training/llada2.py; objective: training/llada2_objective.py; the same curriculum, task weights, saving and
resuming).  Tasks: names, or `all` (the original four),
`hard` (sort, multiply, chain, brackets), `every` (both).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import time

import torch

from lab.tasks import Task, resolve_tasks
from lab.training.batches import BATCH_SIZES, Encoder, make_batch, pack
from lab.training.checkpoint import build_tokenizer, write_checkpoint
from lab.training.curriculum import curriculum_from_args, fitting_task
from lab.training.llada_objective import diffusion_loss, evaluate
from lab.training.model import TrainableLLaDA
from lab.training.run_state import export_weights, init_from, load_state, save_state
from lab.training.schedule import lr_at, parse_task_values, task_cycle


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
        from lab.train_llada2 import export_saved_llada2  # it builds on this module

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
    ap.add_argument("--focus-share", default="0",
                    help="draw this fraction of a task's batches from the hard part of its sizes (multiply: "
                         "both factors of two digits or more; sort: the longer half of its lengths), which "
                         "do not count toward the next level: e.g. multiply=0.5,sort=0.25 (a bare share "
                         "applies to every trained task, and is refused when one has no hard part)")
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
    group.add_argument("--head-dim", type=int, default=None,
                       help="width of each attention head (default: --hidden / --heads); a multiple of 4, as the "
                            "partial RoPE rotates half of it in pairs")
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
    group.add_argument("--mask-range", default="",
                       help="mask ratios drawn from LO-HI instead of the whole (0, 1]: one range, or per task, "
                            "e.g. multiply=0.5-1 (dFactory's LLaDA2 configs use 0.3-0.8)")
    group.add_argument("--running-sum-weight", type=float, default=0.0,
                       help="multiply's running-sum objective (training/running_sums.py): a linear probe on one "
                            "layer's stream regresses each product digit's column sum with carry, its squared "
                            "error added to the loss at this weight (0: off)")
    group.add_argument("--working-first-share", type=float, default=0.0,
                       help="share of the rows whose answers write working (multiply's partial products) that "
                            "mask the result before any of the working, so the result is asked for beside the "
                            "whole working (training/llada2_objective.py); the other rows mask at random")
    group.add_argument("--altered-working-share", type=float, default=0.0,
                       help="share of the rows whose answers write working whose partial products are changed, "
                            "the result being the sum of the written ones, and whose working is given: the "
                            "result learned from the written working, not the prompt (training/altered_working.py)")
    group.add_argument("--running-sum-layer", type=int, default=None,
                       help="the layer (0-based) whose output the probe reads (default: three quarters deep)")
    group.add_argument("--edit-weight", type=float, default=1.0,
                       help="weight of the unmasked positions' loss (per canvas position)")
    group.add_argument("--qk-gain-init", type=float, default=1.0,
                       help="a new run's QK-norm gains (--resume and --init-from load theirs): with QK-norm a logit "
                            "is at most sqrt(head_dim) x g_q x g_k, so the gains are the attention's temperature")
    group.add_argument("--grow-depth", action="store_true",
                       help="with --init-from, the source may have fewer layers: they keep their order spread "
                            "over --layers, and the new layers start as the identity (zero output projections), "
                            "so the deeper model begins computing what the source did (training/grow.py)")
    group.add_argument("--grow-heads", action="store_true",
                       help="with --init-from, the source may have fewer attention heads of the same --head-dim: "
                            "its heads come first, and each new head's output columns start at zero, so the wider "
                            "model begins computing what the source did (training/grow.py)")
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
        from lab.train_llada2 import train_llada2  # it builds on this module

        return train_llada2(args, ap)
    if args.balance_tasks:
        ap.error("--balance-tasks is an --arch llada2 option (the LLaDA-format loop keeps its published recipe)")
    for flag, given in (("--grow-depth", args.grow_depth), ("--grow-heads", args.grow_heads),
                        ("--head-dim", args.head_dim is not None), ("--mask-range", bool(args.mask_range)),
                        ("--running-sum-weight", bool(args.running_sum_weight)),
                        ("--running-sum-layer", args.running_sum_layer is not None),
                        ("--working-first-share", bool(args.working_first_share)),
                        ("--altered-working-share", bool(args.altered_working_share))):
        if given:
            ap.error(f"{flag} is an --arch llada2 option")
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
    curriculum = curriculum_from_args(names, args, ap)
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
        drawn = curriculum.draw(cycle[step % len(cycle)], step, data_rng)
        task = drawn.task
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
        record.update(curriculum.after_batch(drawn, answer_accuracy))
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
