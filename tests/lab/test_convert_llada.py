"""A LLaDA-format checkpoint converted into a LLaDA2-format training model
(training/convert_llada.py): what carries over exactly, what is calibrated, what is
refused."""

from __future__ import annotations

import pathlib

import pytest
import torch

from lab.training import convert_llada, llada2
from lab.training.checkpoint import build_tokenizer, write_checkpoint
from lab.training.model import TrainableLLaDA, rope

HIDDEN, LAYERS, HEADS, MLP = 64, 3, 2, 96
MOE = dict(num_experts=4, experts_per_token=2, n_group=2, topk_group=1, moe_intermediate=48, shared_experts=2,
           dense_layers=1)


def _llada_checkpoint(out: pathlib.Path) -> TrainableLLaDA:
    out.mkdir(parents=True)
    ids = build_tokenizer(out, 256)
    torch.manual_seed(0)
    model = TrainableLLaDA(ids["vocab_size"], HIDDEN, LAYERS, HEADS, MLP, 10000.0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)  # norms that are not the identity, so copying them shows
        for block in model.model.transformer.blocks:  # queries and keys far from unit RMS
            block.q_proj.weight.mul_(3.0)
            block.k_proj.weight.mul_(2.0)
    write_checkpoint(out, model.state_dict(), ids, dict(hidden=HIDDEN, layers=LAYERS, heads=HEADS,
                                                        intermediate=MLP, rope_theta=10000.0),
                     max_len=256, dtype=torch.float32)
    return model.eval()


def _llada2(tmp: pathlib.Path, heads: int = HEADS, moe: dict = MOE, head_dim: int | None = None):
    ids = llada2.build_llada2_tokenizer(tmp / "tok2", 256)
    shape = dict(hidden=HIDDEN, layers=LAYERS, heads=heads, kv_heads=heads, intermediate=MLP, rope_theta=10000.0,
                 head_dim=head_dim)
    torch.manual_seed(1)
    return llada2.build_model(ids, shape, moe).eval(), ids


def test_rotary_pairs_move_to_the_partial_rope_of_the_same_frequency():
    """Permuting a head's dimensions then applying LLaDA2's partial RoPE equals LLaDA's
    full RoPE then the permutation on the rotated half; the other half is untouched."""
    head = 32
    perm = convert_llada.rotary_permutation(head)
    assert sorted(perm.tolist()) == list(range(head))
    x = torch.randn(1, 2, 7, head)
    positions = torch.arange(7)
    full = rope(x, positions, 10000.0)[..., perm]
    partial = llada2.partial_rope(x[..., perm], positions[None], head // 2, 10000.0)
    torch.testing.assert_close(partial[..., : head // 2], full[..., : head // 2], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(partial[..., head // 2:], x[..., perm][..., head // 2:])


def test_conversion_carries_embeddings_norms_and_mlps(tmp_path):
    llada = _llada_checkpoint(tmp_path / "llada")
    model, ids = _llada2(tmp_path)
    prompts = convert_llada.calibration_prompts(tmp_path / "llada", n=2)
    convert_llada.convert_into(model, tmp_path / "llada", tmp_path / "tok2", ids, prompts)
    old = llada.model.transformer
    # Rows by token string: a capital has the same id in both vocabularies, the mask does not.
    from transformers import PreTrainedTokenizerFast

    tok_old = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "llada" / "tokenizer.json"))
    tok_new = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tok2" / "tokenizer.json"))
    for text in ("Q", ";ab=", "7"):
        a, b = tok_old.convert_tokens_to_ids(text), tok_new.convert_tokens_to_ids(text)
        assert torch.equal(model.model.word_embeddings.weight[b], old.wte.weight[a])
        assert torch.equal(model.lm_head.weight[b], old.ff_out.weight[a])
    old_mask = tok_old.convert_tokens_to_ids("<|mdm_mask|>")
    assert ids["mask"] != old_mask
    assert torch.equal(model.model.word_embeddings.weight[ids["mask"]], old.wte.weight[old_mask])
    assert torch.equal(model.model.norm.weight, old.ln_f.weight)

    h = torch.randn(5, HIDDEN)
    for layer, block in zip(model.model.layers, old.blocks):
        want = block.ff_out(torch.nn.functional.silu(block.ff_proj(h)) * block.up_proj(h))
        # A MoE layer's routed experts start silent: the layer is LLaDA's MLP.
        torch.testing.assert_close(layer.mlp(h), want, atol=1e-5, rtol=1e-5)
        assert torch.equal(layer.input_layernorm.weight, block.attn_norm.weight)
        assert torch.equal(layer.post_attention_layernorm.weight, block.ff_norm.weight)
        hd = HIDDEN // HEADS
        perm = convert_llada.rotary_permutation(hd)
        qkv = layer.attention.query_key_value.weight
        for rows, proj in ((qkv[:HEADS * hd], block.q_proj), (qkv[HEADS * hd:2 * HEADS * hd], block.k_proj)):
            assert torch.equal(rows.view(HEADS, hd, -1), proj.weight.view(HEADS, hd, -1)[:, perm])
        assert torch.equal(qkv[2 * HEADS * hd:], block.v_proj.weight)
        assert torch.equal(layer.attention.dense.weight, block.attn_out.weight)


def test_qk_norm_gains_keep_the_attention_logits_near_the_originals(tmp_path):
    """Calibrated gains put the normalised logits at the original's scale: their
    typical magnitude is within a factor 1.5 of LLaDA's (gains of 1 would not be)."""
    llada = _llada_checkpoint(tmp_path / "llada")
    model, ids = _llada2(tmp_path)
    prompts = convert_llada.calibration_prompts(tmp_path / "llada", n=2)
    convert_llada.convert_into(model, tmp_path / "llada", tmp_path / "tok2", ids, prompts)
    (q_rms, k_rms), *_ = convert_llada.qk_rms(llada, prompts)
    x = llada.model.transformer.blocks[0].attn_norm(llada.model.transformer.wte(torch.tensor([prompts[0]])))
    block, att = llada.model.transformer.blocks[0], model.model.layers[0].attention
    q = block.q_proj(x).view(1, -1, HEADS, HIDDEN // HEADS)
    k = block.k_proj(x).view(1, -1, HEADS, HIDDEN // HEADS)
    old_logits = torch.einsum("bqhd,bkhd->bhqk", q, k)
    new_q, new_k, _ = att.project(x, torch.zeros(1, x.shape[1], dtype=torch.long))
    new_logits = new_q @ new_k.transpose(-1, -2)
    ratio = new_logits.abs().mean() / old_logits.abs().mean()
    assert 1 / 1.5 < ratio.item() < 1.5, ratio
    assert not torch.allclose(q_rms.mean(), torch.tensor(1.0), atol=0.2), "the check needs gains far from 1"


def test_shapes_that_cannot_take_the_weights_are_refused(tmp_path):
    _llada_checkpoint(tmp_path / "llada")
    wrong_heads, ids = _llada2(tmp_path, heads=4)
    with pytest.raises(ValueError, match="--heads is 4, the checkpoint has 2; --kv-heads is 4"):
        convert_llada.convert_into(wrong_heads, tmp_path / "llada", tmp_path / "tok2", ids, [])
    narrow, ids = _llada2(tmp_path, moe={**MOE, "shared_experts": 1})
    with pytest.raises(ValueError, match="--moe-intermediate x --shared-experts is 48, the checkpoint's MLP has 96"):
        convert_llada.convert_into(narrow, tmp_path / "llada", tmp_path / "tok2", ids, [])
    narrow_heads, ids = _llada2(tmp_path, head_dim=16)
    with pytest.raises(ValueError, match="--head-dim is 16, the checkpoint has 32"):
        convert_llada.convert_into(narrow_heads, tmp_path / "llada", tmp_path / "tok2", ids, [])
    unshared, ids = _llada2(tmp_path, moe={**MOE, "shared_experts": 0})
    with pytest.raises(ValueError, match="no shared experts"):
        convert_llada.convert_into(unshared, tmp_path / "llada", tmp_path / "tok2", ids, [])
    assert convert_llada.is_llada_checkpoint(tmp_path / "llada")
    assert not convert_llada.is_llada_checkpoint(tmp_path / "tok2")


def test_train_refuses_a_shape_or_option_the_conversion_cannot_honour(tmp_path, capsys):
    from lab import train

    _llada_checkpoint(tmp_path / "llada")
    common = ["--arch", "llada2", "--out", str(tmp_path / "run"), "--init-from", str(tmp_path / "llada"),
              "--hidden", str(HIDDEN), "--layers", str(LAYERS), "--heads", str(HEADS), "--intermediate", str(MLP),
              "--experts", "4", "--experts-per-token", "2", "--expert-groups", "2", "--topk-groups", "1",
              "--moe-intermediate", "48", "--shared-experts", "2", "--rope-theta", "10000", "--tasks", "copy",
              "--steps", "1", "--threads", "1"]
    with pytest.raises(SystemExit):
        train.main([*common, "--mimetic-qk", "0.1"])
    assert "--mimetic-qk" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train.main([*common[:-2], "--heads", "4", "--threads", "1"])
    err = capsys.readouterr().err
    assert "does not fit this shape: --heads is 4, the checkpoint has 2" in err and "saved training state" not in err
