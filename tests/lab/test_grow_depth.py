"""`train --arch llada2 --init-from X --grow-depth`: a trained model deepened without
changing what it computes, so a longer run starts where the shallow one stopped."""

from __future__ import annotations

import pytest
import torch

from tests.llada2_tiny import MOE, SHAPE, SIZES
from lab import train
from lab.training import llada2
from lab.training.grow import grown_state_dict, layer_placement


def _model(layers: int, seed: int, hidden: int = SHAPE["hidden"]) -> llada2.TrainableLLaDA2:
    torch.manual_seed(seed)
    shape = {**SHAPE, "layers": layers, "hidden": hidden}
    model = llada2.TrainableLLaDA2(2304, **{k: shape[k] for k in ("hidden", "layers", "heads", "kv_heads",
                                                                  "intermediate")},
                                   theta=shape["rope_theta"], moe=MOE)
    for moe in model.moe_layers():
        moe.gate.expert_bias.normal_(0, 0.1)
    return model.eval()


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(ids.shape[1])[None].expand_as(ids)
    mask = torch.ones(ids.shape[0], ids.shape[1], ids.shape[1], dtype=torch.bool)
    with torch.no_grad():
        return model.logits(model.hidden_states(ids, positions, mask))


def backward_on_random_targets(model, ids: torch.Tensor) -> None:
    """One training backward (bidirectional, random targets): fills every parameter's grad."""
    model.train()
    positions = torch.arange(ids.shape[1])[None].expand_as(ids)
    mask = torch.ones(ids.shape[0], ids.shape[1], ids.shape[1], dtype=torch.bool)
    target = torch.randint(0, 2304, ids.shape, generator=torch.Generator().manual_seed(1))
    out = model.logits(model.hidden_states(ids, positions, mask))
    torch.nn.functional.cross_entropy(out.flatten(0, 1), target.flatten()).backward()


def test_placement_keeps_order_and_starts_at_the_first_layer():
    assert layer_placement(4, 8) == [0, 2, 4, 6]
    assert layer_placement(4, 6) == [0, 1, 3, 4]
    assert layer_placement(3, 3) == [0, 1, 2]
    with pytest.raises(ValueError, match="cannot grow 4 layers into 3"):
        layer_placement(4, 3)


def test_the_grown_model_computes_what_the_source_did_and_then_learns():
    source, deeper = _model(3, seed=1), _model(6, seed=2)
    deeper.load_state_dict(grown_state_dict(source.state_dict(), deeper.state_dict()))
    ids = torch.randint(0, 2304, (2, 11), generator=torch.Generator().manual_seed(0))
    # The new layers add exact zeros to the residual stream: the same floats come out.
    assert torch.equal(_logits(deeper, ids), _logits(source, ids))
    new_layers = [deeper.model.layers[i] for i in (1, 3, 5)]
    assert all(layer.attention.dense.weight.abs().sum() == 0 for layer in new_layers)

    backward_on_random_targets(deeper, ids)
    for layer in new_layers:
        assert layer.attention.dense.weight.grad.abs().sum() > 0, "a zeroed branch output still learns"
        assert layer.mlp.shared_experts.down_proj.weight.grad.abs().sum() > 0


def test_shapes_that_differ_beyond_depth_are_refused():
    source, wider = _model(3, seed=1), _model(6, seed=2, hidden=32)
    with pytest.raises(ValueError, match="only the layer count may differ"):
        grown_state_dict(source.state_dict(), wider.state_dict())
    partial = {k: v for k, v in source.state_dict().items() if k != "lm_head.weight"}
    with pytest.raises(ValueError, match="has nothing for the deeper model's lm_head.weight"):
        grown_state_dict(partial, _model(6, seed=2).state_dict())


def test_the_training_tool_grows_an_exported_folder(tmp_path, capsys):
    from safetensors.torch import load_file

    first = tmp_path / "first"
    assert train.main(["--arch", "llada2", "--out", str(first), *SIZES, "--tasks", "addition", "--steps", "2",
                       "--eval-every", "1000", "--checkpoint-dtype", "float32"]) == 0
    deep = list(SIZES)
    deep[deep.index("--layers") + 1] = "5"
    second = tmp_path / "second"
    assert train.main(["--arch", "llada2", "--out", str(second), *deep, "--tasks", "addition", "--steps", "0",
                       "--init-from", str(first / "model"), "--grow-depth"]) == 0
    exported = load_file(str(first / "model" / "model.safetensors"))
    started = torch.load(second / "state.pt", weights_only=False)["model"]
    assert torch.equal(started["model.layers.3.attention.dense.weight"],
                       exported["model.layers.2.attention.dense.weight"])  # 3 into 5: 0, 1, 3
    assert started["model.layers.4.mlp.experts.0.down_proj.weight"].abs().sum() == 0
    with pytest.raises(SystemExit):
        train.main(["--arch", "llada2", "--out", str(tmp_path / "third"), *deep, "--tasks", "addition",
                    "--steps", "0", "--init-from", str(first / "model")])
    assert "not a saved training state of this shape" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train.main(["--arch", "llada2", "--out", str(tmp_path / "fourth"), *deep, "--tasks", "addition",
                    "--steps", "0", "--grow-depth"])
    assert "--grow-depth deepens the model --init-from names" in capsys.readouterr().err
