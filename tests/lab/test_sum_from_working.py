"""lab/probes/llada2_sum_from_working.py: one forward with a multiply's working written
into the canvas and its sum masked."""

from __future__ import annotations

import importlib
import pathlib

import torch

from tests.llada2_tiny import SIZES
from lab import train


def test_the_working_is_written_and_only_the_sum_is_masked(tmp_path):
    from lab.train_llada2 import saved_llada2_model
    from lab.training.batches import Llada2Encoder
    from lab.training.run_state import load_state

    out = tmp_path / "run"
    assert train.main(["--arch", "llada2", "--out", str(out), *SIZES, "--tasks", "multiply,addition", "--steps", "1",
                       "--warmup", "1", "--eval-every", "1000", "--save-every", "1",
                       "--checkpoint-dtype", "float32"]) == 0
    state_path = pathlib.Path(out / "state.pt")
    model, ids, _, _ = saved_llada2_model(load_state(state_path), state_path)
    encoder = Llada2Encoder(out / "tokenizer", ids)
    module = importlib.import_module("lab.probes.llada2_sum_from_working")

    seen = {}
    forward = model.hidden_states

    def spy(x, positions, mask):
        seen["x"] = x[0].clone()
        return forward(x, positions, mask)

    model.hidden_states = spy
    hits = module.one_forward(model, encoder, ids, 8, "mul 39*35=", "195+1170=", "1365")
    prompt = encoder.prompt("mul 39*35=")
    shown = encoder.tok.encode("195+1170=", add_special_tokens=False)
    start = len(prompt) + len(shown)
    assert seen["x"][: len(prompt)].tolist() == prompt and seen["x"][len(prompt): start].tolist() == shown
    assert bool((seen["x"][start:] == ids["mask"]).all()) and len(seen["x"]) % 8 == 0
    assert len(hits) == len(encoder.tok.encode("1365", add_special_tokens=False))
    logits = model.logits(forward(seen["x"][None], torch.arange(len(seen["x"]))[None],
                                  module_mask(len(seen["x"]), 8))[0])
    target = encoder.tok.encode("1365", add_special_tokens=False)
    assert hits == (logits[start: start + len(target)].argmax(-1) == torch.tensor(target)).tolist()

    result = module.measure(state_path, 3)
    for name in ("right working", "altered working", "addition"):
        assert 0 <= result[name]["digit_accuracy"] <= 1 and 0 <= result[name]["whole"] <= 3
    assert 0 <= result["altered working"]["true_product_instead"] <= 3
    assert f"| `{state_path}` |" in module.table({"n": 3, "states": {str(state_path): result}})
    shown = []
    real = module.one_forward

    def recording(model, encoder, ids, block, prompt, given, hidden):
        shown.append((prompt, given, hidden))
        return real(model, encoder, ids, block, prompt, given, hidden)

    module.one_forward = recording  # the benchmark module's own function, for this module object only
    padded = module.measure(state_path, 3, width=6)
    assert set(padded) == set(result) and 0 <= padded["right working"]["whole"] <= 3
    worked = [(g, h) for p, g, h in shown if p.startswith("mul ")]
    assert len(worked) == 9, "3 right, 3 altered, 3 true products"
    for given, hidden in worked:
        assert len(given) == 14 and given[6] == "+" and len(hidden) in (6, 7), (given, hidden)


def module_mask(total: int, block: int):
    from lab.training.llada2 import block_causal_mask

    return block_causal_mask((torch.arange(total) // block)[None], torch.ones(1, total, dtype=torch.bool))
