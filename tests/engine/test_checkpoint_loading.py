"""Checkpoints in the real file format, with the real special ids, load with and
without --trust-remote-code and decode exactly."""

from __future__ import annotations

import pytest
from vllm import SamplingParams

from tests import oracle, oracle_dream, oracle_model, oracle_rules
from tests.conftest import close_engine, make_engine
from vllm_dllm.tools.make_tiny import make_tiny

REAL_IDS = {"llada": {"mask": 126336, "eos": 126081, "eot": 126348}, "dream": {"mask": 151666, "eos": 151643}}


@pytest.mark.parametrize("arch, trust_remote_code", [("llada", True), ("dream", True)])
def test_real_vocabulary_checkpoint_decodes_exactly(tmp_path, arch, trust_remote_code):
    model_dir = make_tiny(arch, tmp_path / arch, vocab="real", seed=3, hidden=32, intermediate=64)
    llm = make_engine(str(model_dir), trust_remote_code=trust_remote_code)
    try:
        tokenizer = llm.get_tokenizer()
        prompt = tokenizer.encode("hello world 123", add_special_tokens=False)
        assert tokenizer.convert_tokens_to_ids("<|mdm_mask|>" if arch == "llada" else "<|mask|>") == REAL_IDS[arch]["mask"]
        extra = {"steps": 16, "block_length": 8} if arch == "llada" else {"steps": 16, "alg": "entropy"}
        out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=16, temperature=0.0, extra_args=extra), use_tqdm=False)[0]
    finally:
        close_engine(llm)
    model = oracle_model.load_oracle(str(model_dir))
    ids = REAL_IDS[arch]
    if arch == "llada":
        result = oracle.llada_generate(model, prompt, gen_length=16, steps=16, block_length=8, mask_id=ids["mask"], eos_id=ids["eos"], eot_id=ids["eot"])
    else:
        result = oracle_dream.dream_generate(model, prompt, max_new_tokens=16, steps=16, alg="entropy", mask_id=ids["mask"])
    assert result.ties == 0
    assert list(out.outputs[0].token_ids) == oracle_rules.trim_at_eos(result.tokens, ids["eos"])
    assert isinstance(out.outputs[0].text, str)
