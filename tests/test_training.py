"""The training script writes an unmodified LLaDA checkpoint, logs its loss, and
resumes from its saved state."""

from __future__ import annotations

import json

from tests import oracle
from vllm_dllm.tools import train


def test_train_writes_checkpoint_and_resumes(tmp_path):
    out = tmp_path / "run"
    common = ["--out", str(out), "--hidden", "64", "--layers", "1", "--heads", "1", "--intermediate", "96",
              "--tasks", "addition,copy", "--eval-every", "1000", "--save-every", "2", "--threads", "1"]
    assert train.main([*common, "--steps", "3"]) == 0
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3] and all(r["loss"] > 0 for r in log)

    assert train.main([*common, "--steps", "5", "--resume"]) == 0
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log][3:] == [4, 5]  # resumed after step 3, not from scratch

    model_dir = out / "model"
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LLaDAModelLM"] and config["d_model"] == 64
    generation = json.loads((model_dir / "generation_config.json").read_text())
    eot, eos = generation["eos_token_id"]
    model = oracle.load_oracle(str(model_dir))
    result = oracle.llada_generate(
        model, [10, 20, 30], gen_length=8, steps=8, block_length=8,
        mask_id=config["mask_token_id"], eos_id=eos, eot_id=eot,
    )
    assert len(result.tokens) == 8
