"""`python -m lab.train --arch llada2`: the LLaDA2.x-format run of the
training tool (lab/train.py holds the command line and the LLaDA-format
loop; lab/training/ the task batches, run state, schedule, the model in llada2.py
and its objective in llada2_objective.py).
Block diffusion with LLaDA2.1's token editing, the same curriculum, task weights,
saving and resuming as the LLaDA loop, and an unmodified LLaDA2 checkpoint at the end.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import time

import torch

from lab.tasks import TEST, Instance, Task, resolve_tasks, score, working_length
from lab.training.altered_working import altered_working
from lab.training.batches import BATCH_SIZES, Encoder, Llada2Encoder, make_batch
from lab.training.curriculum import curriculum_from_args
from lab.training.grow import reshape_for_growth
from lab.training.optim import adamw, load_adamw_state
from lab.training.run_state import CURRICULUM_FILE, init_from, load_state, save_state
from lab.training.running_sums import RunningSumTerm, running_sum_targets
from lab.training.schedule import lr_at, parse_mask_ranges, parse_task_values, task_cycle
from lab.training.task_balance import TaskGradientBalance

MOE_ARGS = ("experts", "experts_per_token", "expert_groups", "topk_groups", "moe_intermediate", "shared_experts",
            "dense_layers")


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def llada2_shape(args) -> dict:
    """Sizes of a LLaDA2 run from its arguments (a Namespace, or a saved state's strings)."""
    get = (lambda k: args[k]) if isinstance(args, dict) else (lambda k: getattr(args, k))
    heads, hidden = int(get("heads")), int(get("hidden"))
    kv = get("kv_heads")
    try:
        head_dim = get("head_dim")
    except (KeyError, AttributeError):  # states saved before heads had their own width
        head_dim = None
    return dict(hidden=hidden, layers=int(get("layers")), heads=heads,
                kv_heads=heads if kv in (None, "None") else int(kv), intermediate=int(get("intermediate")),
                rope_theta=float(get("rope_theta")),
                head_dim=hidden // heads if head_dim in (None, "None") else int(head_dim))


def saved_llada2_model(state: dict, state_path: pathlib.Path):
    """(model, ids, shape, moe) of a saved LLaDA2 training state (`state`, loaded from
    `state_path`, whose folder holds the run's tokenizer)."""
    from lab.training import llada2

    saved = state["args"]
    shape = llada2_shape(saved)
    moe = llada2.moe_settings(argparse.Namespace(**{k: int(saved[k]) for k in MOE_ARGS}))
    ids = llada2.build_llada2_tokenizer(state_path.parent / "tokenizer", int(saved["max_len"]))
    model = llada2.build_model(ids, shape, moe)
    model.load_state_dict(state["model"])
    return model, ids, shape, moe


def export_saved_llada2(state: dict, state_path: pathlib.Path, out: pathlib.Path) -> int:
    """The checkpoint of a saved LLaDA2 state (train.export_saved)."""
    saved = state["args"]
    model, _, shape, moe = saved_llada2_model(state, state_path)
    export_llada2(model, out, shape, moe, int(saved["max_len"]), resolve_tasks(saved["tasks"]),
                  saved.get("checkpoint_dtype", "bfloat16"), state.get("curriculum"))
    return state["step"]


def export_llada2(model, out: pathlib.Path, shape: dict, moe: dict, max_len: int, tasks: list[Task],
                  dtype: str = "bfloat16", curriculum: dict | None = None) -> None:
    """An unmodified LLaDA2 checkpoint whose default canvas fits every task's answer,
    with the run's curriculum levels beside it (CURRICULUM_FILE) when it has them."""
    from lab.training.llada2 import write_llada2_checkpoint

    cpu_weights = {k: v.cpu() for k, v in model.state_dict().items()}
    write_llada2_checkpoint(out, cpu_weights, shape, moe, max_len=max_len, dtype=getattr(torch, dtype),
                            generation={"max_new_tokens": max(t.gen_length for t in tasks)})
    if curriculum is not None:
        kept = {"levels": curriculum["levels"]}
        if curriculum.get("settings") is not None:
            kept["settings"] = curriculum["settings"]
        (out / CURRICULUM_FILE).write_text(json.dumps(kept, indent=2, sort_keys=True) + "\n")


@torch.no_grad()
def evaluate_llada2(model, task: Task, encoder: Encoder, n: int, seed: int, block_length: int, threshold: float,
                    gen_length: int | None = None) -> float:
    """LLaDA2.0's rule (threshold, a token per step at least) on the test split."""
    from lab.training.llada2 import generate

    rng = random.Random(seed)
    instances = [task.sample(rng, TEST) for _ in range(n)]
    prompts = [encoder.prompt(i.prompt) for i in instances]
    outs = generate(model, prompts, gen_length or task.gen_length, mask_id=encoder.ids["mask"],
                    eos_id=encoder.ids["eos"], block_length=block_length, threshold=threshold)
    return sum(score(i, encoder.decode(o)) for i, o in zip(instances, outs)) / n


def extra_state(balance: TaskGradientBalance | None, running_sum: RunningSumTerm | None) -> dict:
    """What a run saves beside the model: the task balance and the running-sum probe."""
    extra = {} if balance is None else {"task_balance": balance.state_dict()}
    if running_sum is not None:
        extra["running_sum"] = running_sum.state_dict()
    return extra


DIGITS = "0123456789"


def working_first(instances: list[Instance], encoder: Encoder, share: float, rng: random.Random) -> torch.Tensor | None:
    """Per row, the canvas positions of its answer's working that masking keeps until the
    result is masked (--working-first-share of the rows with working; 0 for the rest),
    or None when no row is ordered."""
    if share == 0:
        return None
    lengths = [working_length(i) for i in instances]
    ordered = [n > 0 and rng.random() < share for n in lengths]
    if not any(ordered):
        return None
    return torch.tensor([len(encoder.tok.encode(i.answer[:n], add_special_tokens=False)) if o else 0
                         for i, n, o in zip(instances, lengths, ordered)])


def alter_working(instances: list[Instance], canvases: list[list[int]], encoder: Encoder, share: float,
                  rng: random.Random) -> torch.Tensor | None:
    """--altered-working-share of the rows that write working get altered partial
    products (training/altered_working.py), their canvases rewritten in place (one
    longer where the altered sum has a digit more than the canvas holds); returns
    per row the canvas positions of working the loss takes as given (0 for the rest),
    or None when no row is altered."""
    if share == 0:
        return None
    given = [0] * len(instances)
    for i, inst in enumerate(instances):
        if inst.task == "multiply" and working_length(inst) and rng.random() < share:
            instances[i] = altered_working(inst, rng)
            answer = len(encoder.tok.encode(instances[i].answer, add_special_tokens=False))
            canvases[i] = encoder.canvas(instances[i].answer, max(len(canvases[i]), answer + 1))  # a carry may add a digit
            given[i] = len(encoder.tok.encode(instances[i].answer[: working_length(instances[i])],
                                              add_special_tokens=False))
    return torch.tensor(given) if any(given) else None


def given_working(task: Task, instances: list[Instance], encoder: Encoder) -> torch.Tensor | None:
    """Per row, the canvas positions of working the loss takes as given, for a task whose
    prompt does not hold its working (`Task.working_given`); None for any other task."""
    if not task.working_given:
        return None
    return torch.tensor([len(encoder.tok.encode(i.answer[: working_length(i)], add_special_tokens=False))
                         for i in instances])


def make_running_sum(args, names: list[str], encoder: Encoder, ap) -> RunningSumTerm | None:
    """The run's running-sum term (--running-sum-weight), or None when it is off."""
    if args.running_sum_weight == 0:
        if args.running_sum_layer is not None:
            ap.error("--running-sum-layer places the probe of --running-sum-weight: give a weight")
        return None
    if "multiply" not in names:
        ap.error("--running-sum-weight trains on multiply's product digits: --tasks has no multiply")
    # The targets sit at canvas position p for the answer's character p.
    if [encoder.decode([t]) for t in encoder.canvas(DIGITS, len(DIGITS) + 1)[: len(DIGITS)]] != list(DIGITS):
        ap.error("--running-sum-weight needs a tokenizer that writes each digit as its own token")
    layer = max(0, args.layers * 3 // 4 - 1) if args.running_sum_layer is None else args.running_sum_layer
    if not 0 <= layer < args.layers:
        ap.error(f"--running-sum-layer {layer}: the model's layers are 0-{args.layers - 1}")
    try:
        return RunningSumTerm(args.hidden, layer, args.running_sum_weight, args.device)
    except ValueError as exc:
        ap.error(f"--running-sum-weight: {exc}")


def train_llada2(args, ap) -> int:
    """The training loop of `--arch llada2` (block diffusion, token editing)."""
    from lab.training import convert_llada, llada2, llada2_objective

    args.out.mkdir(parents=True, exist_ok=True)
    tok_dir = args.out / "tokenizer"
    ids = llada2.build_llada2_tokenizer(tok_dir, args.max_len)
    encoder = Llada2Encoder(tok_dir, ids)
    try:
        tasks = resolve_tasks(args.tasks)
        names = [t.name for t in tasks]
        cycle = task_cycle(names, parse_task_values(args.task_weights, names, "--task-weights"))
        batch_sizes = {n: max(2, round(BATCH_SIZES[n] * args.batch_scale)) for n in names}
        batch_sizes.update(parse_task_values(args.batch_sizes, names, "--batch-sizes"))
        mask_ranges = parse_mask_ranges(args.mask_range, names)
        if min(batch_sizes.values()) < 2:
            raise ValueError("every batch needs at least two rows: mask ratios are stratified over the batch")
        moe = llada2.moe_settings(args)
        llada2.check_moe(moe, args.layers)
        shape = llada2_shape(args)
        if args.head_dim is None and args.hidden % args.heads:
            raise ValueError("--hidden must be a multiple of --heads (or give --head-dim)")
        if args.heads % shape["kv_heads"]:
            raise ValueError("--heads must be a multiple of --kv-heads")
        if shape["head_dim"] <= 0 or shape["head_dim"] % 4:
            given = "--head-dim" if args.head_dim is not None else "--hidden / --heads"
            raise ValueError(f"{given} is {shape['head_dim']}: a head's width must be a positive multiple of 4 "
                             f"(the partial RoPE rotates half of it in pairs)")
        if not 0 <= args.edit_ratio < 1:
            raise ValueError("--edit-ratio must be in [0, 1)")
        if not 0 <= args.working_first_share <= 1:
            raise ValueError("--working-first-share must be in [0, 1]")
        if not 0 <= args.altered_working_share <= 1:
            raise ValueError("--altered-working-share must be in [0, 1]")
    except ValueError as exc:
        ap.error(str(exc))
    if not is_power_of_two(shape["head_dim"]) or shape["head_dim"] < 16:
        print(f"warning: heads of {shape['head_dim']} serve on the CPU, but CUDA's paged Triton attention takes "
              f"powers of two from 16", flush=True)
    if args.init_from is not None and args.resume:
        ap.error("--init-from starts a new run; --resume continues this one: choose one")
    if args.grow_depth and args.init_from is None:
        ap.error("--grow-depth deepens the model --init-from names: give one")
    if args.grow_heads and args.init_from is None:
        ap.error("--grow-heads widens the model --init-from names: give one")
    if args.max_canvas or args.eval_lengths:
        ap.error("--max-canvas and --eval-lengths are LLaDA-format options (a LLaDA2 canvas always runs to its "
                 "block's end)")

    torch.manual_seed(args.seed)
    model = llada2.build_model(ids, shape, moe).to(args.device)
    if args.embedding_std is not None:
        torch.nn.init.normal_(model.model.word_embeddings.weight, std=args.embedding_std)
    if not 0 < args.qk_gain_init < float("inf"):
        ap.error("--qk-gain-init must be a positive number")
    model.set_qk_gains(args.qk_gain_init)
    if args.mimetic_qk is not None:
        if not 0 <= args.mimetic_qk < float("inf"):
            ap.error("--mimetic-qk must be a noise scale >= 0")
        model.mimetic_qk(args.mimetic_qk)
    optim = adamw(model, args.lr)
    task_balance = TaskGradientBalance() if args.balance_tasks else None
    running_sum = make_running_sum(args, names, encoder, ap)
    data_rng = random.Random(args.seed)
    noise = torch.Generator().manual_seed(args.seed)
    curriculum = curriculum_from_args(names, args, ap)
    step = 0
    state_path = args.out / "state.pt"
    if args.init_from is not None:
        if convert_llada.is_llada_checkpoint(args.init_from):
            if args.grow_depth or args.grow_heads:
                ap.error("--grow-depth and --grow-heads grow a LLaDA2 run; a converted --init-from takes "
                         "--layers and --heads as they are")
            if args.mimetic_qk is not None:
                ap.error("--mimetic-qk initialises a new model; a converted --init-from brings its own attention")
            try:
                convert_llada.convert_into(model, args.init_from, tok_dir, ids,
                                           convert_llada.calibration_prompts(args.init_from))
            except ValueError as exc:
                ap.error(f"--init-from {args.init_from}: {exc}")
        else:
            try:
                init_from(args.init_from, model, curriculum, reshape_for_growth(args.grow_depth, args.grow_heads))
            except (OSError, KeyError, ValueError, RuntimeError) as exc:
                ap.error(f"--init-from {args.init_from}: not a saved training state of this shape ({exc!r})")
        print(f"initialised from {args.init_from}", flush=True)
    if args.resume and state_path.exists():
        state = load_state(state_path)
        saved_shape = llada2_shape(state["args"])
        if saved_shape != shape:
            differ = ", ".join(f"{k} {saved_shape[k]} (given {shape[k]})" for k in shape if saved_shape[k] != shape[k])
            ap.error(f"--resume: {state_path} was trained with {differ}: give the run's own sizes")
        model.load_state_dict(state["model"])
        load_adamw_state(optim, model, state["optim"])
        data_rng.setstate(state["data_rng"])
        noise.set_state(state["noise"])
        try:
            curriculum.load_state_dict(state["curriculum"])
        except ValueError as exc:
            ap.error(f"--resume: {exc}")
        if task_balance is not None and "task_balance" in state:
            task_balance.load_state_dict(state["task_balance"])
        if running_sum is not None and "running_sum" in state:
            try:
                running_sum.load_state_dict(state["running_sum"])
            except ValueError as exc:
                ap.error(f"--resume: {exc}")
        elif running_sum is None and "running_sum" in state:
            print("warning: the run was trained with --running-sum-weight; resumed without it, its probe is "
                  "dropped at the next save", flush=True)
        step = state["step"]
        print(f"resumed at step {step}", flush=True)
    params = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    active = params - experts + experts * moe["experts_per_token"] // moe["num_experts"]
    log = (args.out / "train_log.jsonl").open("a")
    print(f"{params / 1e6:.2f}M parameters ({active / 1e6:.2f}M active per token); vocab {ids['vocab_size']}",
          flush=True)

    generated = [t for t in tasks if not t.working_given]  # what generation can be scored on
    start = time.time()
    model.train()
    while step < args.steps:
        if args.minutes is not None and time.time() - start > args.minutes * 60:
            break
        drawn = curriculum.draw(cycle[step % len(cycle)], step, data_rng)
        task = drawn.task
        instances, prompts, canvases = make_batch(task, encoder, data_rng, batch_sizes[task.name])
        if task.working_given:
            given = given_working(task, instances, encoder)
        else:
            given = alter_working(instances, canvases, encoder, args.altered_working_share, data_rng)
        canvases = [llada2_objective.extend_to_block(c, len(p), args.block_length, ids["eos"])
                    for p, c in zip(prompts, canvases)]
        working = working_first(instances, encoder, args.working_first_share, data_rng)
        sums = None
        if running_sum is not None:
            sums = (running_sum, running_sum_targets(instances, max(map(len, canvases))))
        for group in optim.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        loss, stats = llada2_objective.block_diffusion_loss(
            model, prompts, canvases, args.block_length, ids["mask"], noise, pad_id=ids["eos"],
            edit_ratio=args.edit_ratio, edit_weight=args.edit_weight, mask_range=mask_ranges[task.name],
            running_sum=sums, working=working, given=given,
        )
        optim.zero_grad(set_to_none=True)
        loss.backward()
        grad_scale = None
        if task_balance is not None:
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            grad_scale = task_balance.scale(task.name, torch.nn.utils.get_total_norm(grads).item())
            for grad in grads:
                grad.mul_(grad_scale)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        if running_sum is not None:
            running_sum.step()
        model.balance(args.bias_update)
        step += 1
        record = {"step": step, "task": task.name, "loss": round(loss.item(), 4),
                  **{k: None if v is None else round(v, 3) for k, v in stats.items()},
                  "elapsed_s": round(time.time() - start, 1)}
        if grad_scale is not None:
            record["grad_scale"] = round(grad_scale, 3)
        record.update(curriculum.after_batch(drawn, stats["answer_accuracy"]))
        if step % args.eval_every == 0 or step == args.steps:
            model.eval()
            record["accuracy"] = {
                t.name: evaluate_llada2(model, t, encoder, args.eval_n, 1, args.block_length, args.eval_threshold)
                for t in generated
            }
            if any(curriculum.level(t.name, step) < 1.0 for t in generated):
                record["accuracy_at_curriculum_sizes"] = {
                    t.name: evaluate_llada2(model, curriculum.task(t.name, step), encoder, args.eval_n, 1,
                                            args.block_length, args.eval_threshold)
                    for t in generated
                }
            model.train()
        log.write(json.dumps(record) + "\n")
        log.flush()
        if step % 20 == 0 or "accuracy" in record or "level" in record:
            print(json.dumps(record), flush=True)
        if step % args.save_every == 0:
            save_state(state_path, model, optim, data_rng, noise, step, args, curriculum,
                       **extra_state(task_balance, running_sum))
    save_state(state_path, model, optim, data_rng, noise, step, args, curriculum,
               **extra_state(task_balance, running_sum))
    export_llada2(model, args.out / "model", shape, moe, args.max_len, tasks, args.checkpoint_dtype,
                  curriculum.state_dict())
    print(f"wrote {args.out / 'model'} after {step} steps", flush=True)
    return 0
