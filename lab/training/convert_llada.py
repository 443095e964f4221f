"""A trained LLaDA-format checkpoint as the starting point of a LLaDA2-format run.

LLaDA2.0 is not trained from scratch: it converts a pretrained model (Ling 2.0) into
block diffusion by continued training.  Our LLaDA-format task model already reads,
copies, adds and looks keys up, and the LLaDA2-format model never formed the lookup
from scratch (lab/training-log.md), so a LLaDA2 run can start from it the same way.
The conversion keeps the function where the two formats allow it:

* Embeddings and LM head: rows moved by token string (the task vocabulary is shared;
  LLaDA's mask and end-of-text map to LLaDA2's, LLaDA's chat specials have no
  counterpart and keep the fresh initialisation).
* Attention: q, k, v and the output projection as they are, with the head dimensions
  of q and k permuted so that LLaDA2's partial RoPE (rotary on the first half of each
  head) rotates the LLaDA pairs of the same frequencies: LLaDA2's pair i (of 16, at
  theta^(-i/16)) is LLaDA's pair 2i (of 32, at theta^(-2i/32)).  LLaDA's odd pairs go
  to the unrotated half: that half of the positional signal is lost and retrained.
  QK-norm is new: its gains are set to the typical RMS of each head's queries and keys
  on task prompts, so a normalised logit is near the original one.
* MLPs: the dense layers take LLaDA's MLP; each MoE layer's shared experts take it
  whole (their width must equal LLaDA's MLP width) and the routed experts start with
  zero output projections (sparse upcycling with the layer's function unchanged):
  they join as the training gives them gradients.
* The mask becomes block-causal, which the continued training adapts to.
"""

from __future__ import annotations

import json
import pathlib
import random

import torch


def is_llada_checkpoint(path: pathlib.Path) -> bool:
    config = path / "config.json"
    return path.is_dir() and config.exists() and json.loads(config.read_text()).get("model_type") == "llada"


def _token_map(llada_dir: pathlib.Path, llada2_tokenizer: pathlib.Path, llada2_ids: dict) -> dict[int, int]:
    """LLaDA2 id -> LLaDA id for every token both vocabularies hold."""
    def vocab(path: pathlib.Path) -> dict[str, int]:
        data = json.loads((path / "tokenizer.json").read_text())
        return {**data["model"]["vocab"], **{t["content"]: t["id"] for t in data["added_tokens"]}}

    old, new = vocab(llada_dir), vocab(llada2_tokenizer)
    pairs = {new[s]: old[s] for s in new.keys() & old.keys()}
    pairs[llada2_ids["mask"]] = old["<|mdm_mask|>"]
    pairs[llada2_ids["eos"]] = old["<|endoftext|>"]
    return pairs


def rotary_permutation(head_dim: int) -> torch.Tensor:
    """perm[i] = the LLaDA head dimension that LLaDA2's dimension i takes (full
    rotate-half RoPE -> rotate-half on the first half of the head)."""
    half, quarter = head_dim // 2, head_dim // 4
    rotated = [2 * i for i in range(quarter)] + [2 * i + half for i in range(quarter)]
    rest = [2 * i + 1 for i in range(quarter)] + [2 * i + 1 + half for i in range(quarter)]
    return torch.tensor(rotated + rest)


@torch.no_grad()
def qk_rms(llada_model, prompts: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the mean RMS of each head's queries and of its keys over `prompts`."""
    blocks = llada_model.model.transformer.blocks
    sums = [[torch.zeros(b.heads), torch.zeros(b.heads)] for b in blocks]
    count = 0
    hooks = []
    for layer, block in enumerate(blocks):
        for which, proj in enumerate((block.q_proj, block.k_proj)):
            def record(_m, _inp, out, layer=layer, which=which, heads=block.heads):
                per_head = out.float().view(*out.shape[:-1], heads, -1)
                sums[layer][which] += per_head.pow(2).mean(-1).sqrt().reshape(-1, heads).sum(0)
            hooks.append(proj.register_forward_hook(record))
    try:
        for prompt in prompts:
            llada_model.hidden_states(torch.tensor([prompt]))
            count += len(prompt)
    finally:
        for hook in hooks:
            hook.remove()
    return [(q / count, k / count) for q, k in sums]


def load_llada(llada_dir: pathlib.Path):
    """The LLaDA-format checkpoint as training/model.py's TrainableLLaDA (float32)."""
    from safetensors.torch import load_file

    from lab.training.model import TrainableLLaDA

    cfg = json.loads((llada_dir / "config.json").read_text())
    model = TrainableLLaDA(cfg["embedding_size"], cfg["d_model"], cfg["n_layers"], cfg["n_heads"],
                           cfg["mlp_hidden_size"], cfg["rope_theta"])
    model.load_state_dict({k: v.float() for k, v in load_file(str(llada_dir / "model.safetensors")).items()})
    return model.eval(), cfg


def _mlp_taking_llada(layer):
    """(the MLP that takes LLaDA's, the option that sizes it): a dense layer's own MLP,
    a MoE layer's shared experts (None when it has none)."""
    if hasattr(layer.mlp, "shared_experts"):
        return layer.mlp.shared_experts, "--moe-intermediate x --shared-experts"
    return layer.mlp, "--intermediate"


def check_convertible(cfg: dict, model) -> None:
    """Refuse a LLaDA2 shape that cannot take the LLaDA weights, naming every mismatch."""
    layers = model.model.layers
    att = layers[0].attention
    found = {"--hidden": (att.dense.out_features, cfg["d_model"]), "--layers": (len(layers), cfg["n_layers"]),
             "--heads": (att.heads, cfg["n_heads"]), "--kv-heads": (att.kv_heads, cfg["n_kv_heads"]),
             "--head-dim": (att.head_dim, cfg["d_model"] // cfg["n_heads"]),
             "--rope-theta": (att.theta, cfg["rope_theta"])}
    problems = [f"{k} is {a}, the checkpoint has {b}" for k, (a, b) in found.items() if a != b]
    for layer in (layers[0], layers[-1]):  # dense first layers, MoE at least the last (check_moe)
        mlp, option = _mlp_taking_llada(layer)
        if mlp is None:
            problems.append("the MoE layers have no shared experts to take the checkpoint's MLP (--shared-experts)")
        elif mlp.up_proj.out_features != cfg["mlp_hidden_size"]:
            problems.append(f"{option} is {mlp.up_proj.out_features}, the checkpoint's MLP has "
                            f"{cfg['mlp_hidden_size']}")
    if att.head_dim % 4 or att.rotary_dim != att.head_dim // 2:
        problems.append("moving RoPE pairs needs a head dimension divisible by 4, rotary on its first half")
    if problems:
        raise ValueError("the LLaDA checkpoint does not fit this shape: " + "; ".join(dict.fromkeys(problems)))


@torch.no_grad()
def convert_into(model, llada_dir: pathlib.Path, llada2_tokenizer: pathlib.Path, llada2_ids: dict,
                 prompts: list[list[int]]) -> None:
    """Load the LLaDA checkpoint at `llada_dir` into the LLaDA2 training `model` (see
    the module docstring); `prompts` (LLaDA-format token ids) calibrate the QK-norm gains."""
    llada, cfg = load_llada(llada_dir)  # on the CPU; copy_ moves values to the model's device
    check_convertible(cfg, model)
    old = llada.model.transformer
    rows = _token_map(llada_dir, llada2_tokenizer, llada2_ids)
    device = model.lm_head.weight.device
    new_ids, old_ids = torch.tensor(list(rows), device=device), torch.tensor(list(rows.values()))
    model.model.word_embeddings.weight[new_ids] = old.wte.weight[old_ids].to(device)
    model.lm_head.weight[new_ids] = old.ff_out.weight[old_ids].to(device)
    model.model.norm.weight.copy_(old.ln_f.weight)
    perm = rotary_permutation(model.model.layers[0].attention.head_dim)
    for layer, block, (q_rms, k_rms) in zip(model.model.layers, old.blocks, qk_rms(llada, prompts)):
        att = layer.attention
        hd = att.head_dim

        def per_head(weight, heads):
            return weight.view(heads, hd, -1)[:, perm].reshape(heads * hd, -1)

        att.query_key_value.weight.copy_(torch.cat([per_head(block.q_proj.weight, att.heads),
                                                    per_head(block.k_proj.weight, att.kv_heads), block.v_proj.weight]))
        # One gain per head dimension is shared by all heads: the heads' mean RMS.
        att.query_layernorm.weight.fill_(q_rms.mean().item())
        att.key_layernorm.weight.fill_(k_rms.mean().item())
        att.dense.weight.copy_(block.attn_out.weight)
        layer.input_layernorm.weight.copy_(block.attn_norm.weight)
        layer.post_attention_layernorm.weight.copy_(block.ff_norm.weight)
        dense, _ = _mlp_taking_llada(layer)
        dense.gate_proj.weight.copy_(block.ff_proj.weight)
        dense.up_proj.weight.copy_(block.up_proj.weight)
        dense.down_proj.weight.copy_(block.ff_out.weight)
        for expert in getattr(layer.mlp, "experts", []):
            expert.down_proj.weight.zero_()


def calibration_prompts(llada_dir: pathlib.Path, n: int = 8, seed: int = 0) -> list[list[int]]:
    """LLaDA-format prompts of the four tasks the checkpoint was trained on."""
    from lab.tasks import TASKS, TRAIN
    from lab.training.batches import Encoder

    ids = json.loads((llada_dir / "config.json").read_text())
    encoder = Encoder(llada_dir, {"eos": ids["eos_token_id"], "mask": ids["mask_token_id"]})
    rng = random.Random(seed)
    return [encoder.prompt(task.sample(rng, TRAIN).prompt) for task in TASKS.values() for _ in range(n)]
