"""A training run's saved state: written whole or not at all, loaded onto the CPU,
reduced to its weights to carry between machines, and read back by a new run
(`init_from`) from a state or an exported checkpoint folder."""

from __future__ import annotations

import json
import pathlib

import torch

from lab.training.curriculum import Curriculum


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
