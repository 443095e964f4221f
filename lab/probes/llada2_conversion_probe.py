"""How much of a LLaDA-format model's function survives its conversion into the
LLaDA2 shape (training/convert_llada.py), and which format change costs what.

One forward over LLaDA-framed prompts of the four tasks with the canvas masked and a
full attention mask (the LLaDA model's own setting), scored per canvas position
(answer and end-of-text) by argmax.  Rows: the LLaDA model; the converted model; and
two diagnostics that undo one format change each: QK-norm replaced by the identity,
and RoPE over the whole head (the unpermuted LLaDA q/k rows, rotary_dim = head_dim).
With both undone the converted model is the LLaDA model.  Inputs are embedded and
scored with the LLaDA model's own rows, so the chat frame is LLaDA's in every row.

    python -m lab.probes.llada2_conversion_probe [--model vllm_dllm/default_model] [--n 16]
"""

from __future__ import annotations

import argparse
import pathlib
import random
import tempfile

import torch

from lab.tasks import TASKS, TEST
from lab.training.batches import Encoder
from lab.training import convert_llada, llada2


def converted_model(src: pathlib.Path, tok_dir: pathlib.Path, cfg: dict):
    ids = llada2.build_llada2_tokenizer(tok_dir, 512)
    moe = dict(num_experts=16, experts_per_token=4, n_group=4, topk_group=2, moe_intermediate=cfg["mlp_hidden_size"] // 4,
               shared_experts=4, dense_layers=1)
    shape = dict(hidden=cfg["d_model"], layers=cfg["n_layers"], heads=cfg["n_heads"], kv_heads=cfg["n_kv_heads"],
                 intermediate=cfg["mlp_hidden_size"], rope_theta=cfg["rope_theta"])
    torch.manual_seed(0)
    model = llada2.build_model(ids, shape, moe).eval()
    convert_llada.convert_into(model, src, tok_dir, ids, convert_llada.calibration_prompts(src))
    return model


def undo(model, llada, *, qk_norm: bool, partial_rope: bool) -> None:
    for layer, block in zip(model.model.layers, llada.model.transformer.blocks):
        att = layer.attention
        if qk_norm:
            att.query_layernorm.forward = lambda x: x
            att.key_layernorm.forward = lambda x: x
        if partial_rope:
            att.rotary_dim = att.head_dim
            rows = att.heads * att.head_dim
            with torch.no_grad():
                att.query_key_value.weight[:rows] = block.q_proj.weight
                att.query_key_value.weight[rows:2 * rows] = block.k_proj.weight


@torch.no_grad()
def canvas_accuracy(forward, encoder: Encoder, cfg: dict, n: int) -> dict[str, float]:
    rng = random.Random(0)
    scores = {}
    for task in TASKS.values():
        hits = total = 0
        for _ in range(n):
            inst = task.sample(rng, TEST)
            prompt, canvas = encoder.prompt(inst.prompt), encoder.canvas(inst.answer, task.gen_length)
            ids = torch.tensor([prompt + [cfg["mask_token_id"]] * len(canvas)])
            predicted = forward(ids)[0, len(prompt):].argmax(-1)
            hits += (predicted == torch.tensor(canvas)).sum().item()
            total += len(canvas)
        scores[task.name] = hits / total
    return scores


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=pathlib.Path, default=pathlib.Path("vllm_dllm/default_model"))
    ap.add_argument("--n", type=int, default=16, help="instances per task")
    args = ap.parse_args()
    llada, cfg = convert_llada.load_llada(args.model)
    eot = Encoder(args.model, {}).tok.convert_tokens_to_ids("<|eot_id|>")
    encoder = Encoder(args.model, {"eos": cfg["eos_token_id"], "mask": cfg["mask_token_id"], "eot": eot})
    old = llada.model.transformer

    def through(model):
        def forward(ids):
            t = ids.shape[1]
            h = old.wte(ids)
            positions = torch.arange(t)[None]
            full = torch.ones(1, t, t, dtype=torch.bool)
            for layer in model.model.layers:
                h = layer(h, positions, full, torch.ones(1, t, dtype=torch.bool))
            return old.ff_out(model.model.norm(h))
        return forward

    rows = {"LLaDA model": llada}
    with tempfile.TemporaryDirectory() as tmp:
        for name, qk, rope in (("converted", False, False), ("converted, QK-norm as identity", True, False),
                               ("converted, full-head RoPE", False, True), ("converted, both", True, True)):
            model = converted_model(args.model, pathlib.Path(tmp) / "tok", cfg)
            undo(model, llada, qk_norm=qk, partial_rope=rope)
            rows[name] = through(model)
        print("| | " + " | ".join(TASKS) + " |\n|---|" + "---|" * len(TASKS))
        for name, forward in rows.items():
            scores = canvas_accuracy(forward, encoder, cfg, args.n)
            print(f"| {name} | " + " | ".join(f"{scores[t]:.2f}" for t in TASKS) + " |", flush=True)


if __name__ == "__main__":
    main()
