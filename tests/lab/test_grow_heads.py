"""`train --arch llada2 --init-from X --grow-heads`: a trained model given more attention
heads without changing what it computes, and heads whose width is not --hidden / --heads
carried through the checkpoint to the plugin's model."""

from __future__ import annotations

import pytest
import torch

from tests.oracle_llada2 import block_causal_mask, load_llada2_oracle
from tests.lab.test_grow_depth import backward_on_random_targets
from tests.llada2_tiny import MOE, SHAPE, SIZES
from lab import train
from lab.training import llada2
from lab.training.grow import reshape_for_growth, widened_heads

HEAD_DIM = SHAPE["hidden"] // SHAPE["heads"]


def _model(heads: int, kv_heads: int, seed: int, layers: int = SHAPE["layers"],
           head_dim: int = HEAD_DIM) -> llada2.TrainableLLaDA2:
    torch.manual_seed(seed)
    model = llada2.TrainableLLaDA2(2304, SHAPE["hidden"], layers, heads, kv_heads, SHAPE["intermediate"],
                                   theta=SHAPE["rope_theta"], moe=MOE, head_dim=head_dim)
    for moe in model.moe_layers():
        moe.gate.expert_bias.normal_(0, 0.1)
    return model.eval()


def _logits(model, ids: torch.Tensor, block: int | None = None) -> torch.Tensor:
    positions = torch.arange(ids.shape[1])[None].expand_as(ids)
    blocks = positions // (block or ids.shape[1])
    mask = llada2.block_causal_mask(blocks, torch.ones_like(ids, dtype=torch.bool))
    with torch.no_grad():
        return model.logits(model.hidden_states(ids, positions, mask))


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    # float32 both sides, the same weights: the wider query/key/value GEMM and the output
    # projection's extra zero columns change only how float sums are blocked (~1e-6 on
    # logits of O(1)); a head reading the wrong keys or a non-zero new column moves
    # them by 1e-2 or more.
    assert (got - want).abs().max().item() < 1e-4 * max(1.0, want.abs().max().item())


def test_the_wider_model_computes_what_the_source_did_and_its_new_heads_learn():
    source, wider = _model(4, 2, seed=1), _model(8, 4, seed=2)
    wider.load_state_dict(widened_heads(source.state_dict(), wider.state_dict()))
    ids = torch.randint(0, 2304, (2, 13), generator=torch.Generator().manual_seed(0))
    _close(_logits(wider, ids, block=4), _logits(source, ids, block=4))
    for old, new in zip(source.model.layers, wider.model.layers):
        q_rows = 4 * HEAD_DIM
        assert torch.equal(new.attention.query_key_value.weight[:q_rows], old.attention.query_key_value.weight[:q_rows])
        assert new.attention.dense.weight[:, q_rows:].abs().sum() == 0
        assert new.attention.query_key_value.weight[q_rows:2 * q_rows].abs().sum() > 0, "new query heads start random"

    backward_on_random_targets(wider, ids)
    for layer in wider.model.layers:
        assert layer.attention.dense.weight.grad[:, 4 * HEAD_DIM:].abs().sum() > 0, "zeroed columns still learn"


def test_heads_and_depth_grow_together():
    source, grown = _model(4, 2, seed=1, layers=2), _model(8, 4, seed=2, layers=4)
    grown.load_state_dict(reshape_for_growth(depth=True, heads=True)(source.state_dict(), grown.state_dict()))
    ids = torch.randint(0, 2304, (1, 9), generator=torch.Generator().manual_seed(0))
    _close(_logits(grown, ids), _logits(source, ids))
    assert grown.model.layers[3].attention.dense.weight.abs().sum() == 0, "a new layer starts as the identity"


@pytest.mark.parametrize("to, message", [
    (dict(heads=8, kv_heads=4, head_dim=8), "heads of 16 cannot widen into heads of 8"),
    (dict(heads=2, kv_heads=2), "cannot grow 4 query / 2 key-value heads into 2 / 2"),
    (dict(heads=8, kv_heads=2), "4 query heads per 2 key-value heads cannot widen into 8 per 2"),
    (dict(heads=8, kv_heads=4, layers=4), "3 layers against 4 \\(add --grow-depth\\)"),
])
def test_widths_that_cannot_keep_the_function_are_refused(to, message):
    source, target = _model(4, 2, seed=1), _model(seed=2, **to)
    with pytest.raises(ValueError, match=message):
        reshape_for_growth(depth=False, heads=True)(source.state_dict(), target.state_dict())


def test_the_training_tool_widens_an_exported_folder_that_the_plugin_serves(tmp_path, capsys):
    from safetensors.torch import load_file

    from tests.engine.test_llada2_model import BLOCK, run_plugin_model

    first = tmp_path / "first"
    assert train.main(["--arch", "llada2", "--out", str(first), *SIZES, "--tasks", "addition", "--steps", "2",
                       "--eval-every", "1000", "--checkpoint-dtype", "float32"]) == 0
    wide = list(SIZES)
    wide[wide.index("--heads") + 1], wide[wide.index("--kv-heads") + 1] = "8", "4"
    wide += ["--head-dim", str(HEAD_DIM)]  # 8 heads of 16 on a 64-wide stream
    second = tmp_path / "second"
    assert train.main(["--arch", "llada2", "--out", str(second), *wide, "--tasks", "addition", "--steps", "2",
                       "--lr", "1e-3", "--eval-every", "1000", "--checkpoint-dtype", "float32",
                       "--init-from", str(first / "model"), "--grow-heads"]) == 0
    exported = load_file(str(first / "model" / "model.safetensors"))
    state = torch.load(second / "state.pt", weights_only=False)
    assert int(state["args"]["head_dim"]) == HEAD_DIM
    assert state["model"]["model.layers.0.attention.dense.weight"].shape == (64, 8 * HEAD_DIM)
    assert not torch.equal(state["model"]["model.layers.2.attention.dense.weight"][:, : 4 * HEAD_DIM],
                           exported["model.layers.2.attention.dense.weight"]), "it trained on from the source"

    # The checkpoint says head_dim 16 beside hidden 64 and 8 heads; the oracle and the
    # plugin's model (vLLM's layers) both read it so, and agree with the training forward.
    import json

    model_dir = second / "model"
    config = json.loads((model_dir / "config.json").read_text())
    assert (config["hidden_size"], config["num_attention_heads"], config["head_dim"]) == (64, 8, HEAD_DIM)
    model = llada2.build_model(llada2.build_llada2_tokenizer(tmp_path / "tok", 512),
                               {**SHAPE, "heads": 8, "kv_heads": 4, "head_dim": HEAD_DIM}, MOE)
    model.load_state_dict(state["model"])
    model.eval()
    tokens = torch.randint(3, 250, (2 * BLOCK + 3,), generator=torch.Generator().manual_seed(5))
    oracle = load_llada2_oracle(str(model_dir))
    want = oracle.forward(tokens, block_causal_mask(len(tokens), BLOCK))
    _close(_logits(model, tokens[None], block=BLOCK)[0], want)
    steps = run_plugin_model(str(model_dir), tokens.tolist(), [[0, 1, 2]])
    # float32 both sides, summation order only (as tests/engine/test_llada2_model.py states).
    torch.testing.assert_close(steps[0], want, atol=2e-3, rtol=0)

    with pytest.raises(SystemExit):
        train.main(["--arch", "llada2", "--out", str(tmp_path / "third"), *wide, "--tasks", "addition",
                    "--steps", "0", "--grow-heads"])
    assert "--grow-heads widens the model --init-from names" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train.main(["--arch", "llada2", "--out", str(tmp_path / "fourth"), *wide, "--tasks", "addition",
                    "--steps", "0", "--init-from", str(first / "model")])
    assert "not a saved training state of this shape" in capsys.readouterr().err
    bad = [*SIZES, "--head-dim", "18"]
    with pytest.raises(SystemExit):
        train.main(["--arch", "llada2", "--out", str(tmp_path / "fifth"), *bad, "--tasks", "addition", "--steps", "0"])
    assert "--head-dim is 18: a head's width must be a positive multiple of 4" in capsys.readouterr().err
    odd = list(SIZES)
    odd[odd.index("--hidden") + 1] = "72"  # 18 per head
    with pytest.raises(SystemExit):
        train.main(["--arch", "llada2", "--out", str(tmp_path / "fifth"), *odd, "--tasks", "addition", "--steps", "0"])
    assert "--hidden / --heads is 18: a head's width" in capsys.readouterr().err
    # A resumed run must be given its own sizes; a forgotten --head-dim is named, not a traceback.
    with pytest.raises(SystemExit):
        train.main(["--arch", "llada2", "--out", str(second), *wide[:-2], "--tasks", "addition", "--steps", "3",
                    "--resume"])
    assert "was trained with head_dim 16 (given 8)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train.main(["--out", str(tmp_path / "sixth"), "--tasks", "addition", "--steps", "0", "--grow-heads"])
    assert "--grow-heads is an --arch llada2 option" in capsys.readouterr().err
