"""Dream's top-k / top-p at temperature 0: every route reaches the rule.

vLLM resets `top_k`/`top_p` of a greedy request to neutral values in
`SamplingParams.__post_init__`, yet Dream's `diffusion_generate` renormalises its
confidences over the top-k/top-p set at temperature 0 as well, which changes which
positions `maskgit_plus` and `entropy` commit.  The routes that reach the rule: the
checkpoint's generation_config.json (vLLM's server default; also
`--override-generation-config`) and `extra_args` / `vllm_xargs`.  The request fields
themselves are answered with a 400 by the front end (tests/server/test_frontend.py).

One engine on a tiny real-format Dream checkpoint (real vocabulary) whose
generation_config.json says top_k=50; every case is checked token for token against
the independent oracle.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from vllm import SamplingParams

from tests import oracle, oracle_dream, oracle_model, oracle_rules
from tests.conftest import close_engine, make_engine, random_prompt
from tests.tie_free import compare_each_case
from tests.engine.test_exact_decoding import _special

GEN_CONFIG_TOP_K = 50

# (name, extra_args, the filter the reference applies)
CASES = [
    ("maskgit_plus, top_k=50 from generation_config", {"alg": "maskgit_plus"}, {"top_k": 50}),
    ("entropy, top_k=50 from generation_config", {"alg": "entropy"}, {"top_k": 50}),
    ("maskgit_plus, top_p=0.9 via extra_args", {"alg": "maskgit_plus", "top_k": 0, "top_p": 0.9}, {"top_p": 0.9}),
    ("entropy, top_p=0.9 via extra_args", {"alg": "entropy", "top_k": 0, "top_p": 0.9}, {"top_p": 0.9}),
    ("entropy, top_k=20 via extra_args", {"alg": "entropy", "top_k": 20}, {"top_k": 20}),
    ("maskgit_plus, top_k=50 and top_p=0.9", {"alg": "maskgit_plus", "top_p": 0.9}, {"top_k": 50, "top_p": 0.9}),
    ("maskgit_plus, filter off via extra_args", {"alg": "maskgit_plus", "top_k": 0}, {}),
]
GEN_LENGTH = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from vllm_dllm.tools.make_tiny import make_tiny

    path = Path(make_tiny("dream", tmp_path_factory.mktemp("dream-filters") / "dream", vocab="real", seed=7))
    gen_path = path / "generation_config.json"
    gen = json.loads(gen_path.read_text())
    gen.update(top_k=GEN_CONFIG_TOP_K, temperature=0.0)
    gen_path.write_text(json.dumps(gen))
    return str(path)


@pytest.fixture(scope="module")
def llm(model_dir):
    engine = make_engine(model_dir)
    yield engine
    close_engine(engine)


def test_generation_config_top_k_is_a_server_default(llm):
    from vllm_dllm.serving.server_config import server_defaults

    assert server_defaults(llm.llm_engine.vllm_config).overrides["top_k"] == GEN_CONFIG_TOP_K


def test_top_k_top_p_at_temperature_0_match_the_reference(llm, model_dir):
    ids = _special(model_dir)
    model = oracle_model.load_oracle(model_dir)
    filter_mattered = set()

    def compare_draw(draw: int, pending: list[tuple]) -> list[tuple]:
        rng = random.Random(99 + draw)
        prompts = [random_prompt(rng, 6 + CASES.index(case)) for case in pending]
        params = [
            SamplingParams(max_tokens=GEN_LENGTH, temperature=0.0, seed=0, extra_args={"steps": GEN_LENGTH, **extra})
            for _, extra, _ in pending
        ]
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        tied = []
        for case, prompt, out in zip(pending, prompts, outputs):
            name, extra, filters = case

            def reference(**kw):
                result = oracle_dream.dream_generate(
                    model, prompt, max_new_tokens=GEN_LENGTH, steps=GEN_LENGTH, alg=extra["alg"],
                    temperature=0.0, mask_id=ids["mask"], **kw,
                )
                return oracle_rules.trim_at_eos(result.tokens, ids["eos"]), result.ties

            want, ties = reference(**filters)
            if ties:
                tied.append(case)  # either side of an exact tie is right: draw this case again
                continue
            got = list(out.outputs[0].token_ids)
            assert got == want, f"{name}: plugin {got} != reference {want}"
            if filters and reference()[0] != want:
                filter_mattered.add(name)
        return tied

    compare_each_case(CASES, compare_draw)
    # Without this the cases would pass with the filter ignored.
    assert len(filter_mattered) >= 2, "the filters changed no reference output: the cases test nothing"


# ---------------------------------------------------------------------------
# Server defaults: what vLLM resolved from generation_config.json and
# --override-generation-config (config only, no engine)
# ---------------------------------------------------------------------------


def _engine_config(model_dir, **kwargs):
    import vllm_dllm
    from vllm.engine.arg_utils import EngineArgs

    vllm_dllm.register()
    args = EngineArgs(model=str(model_dir), max_model_len=256, enforce_eager=True, **kwargs)
    return args.create_engine_config()


def _tiny_with_generation_config(tmp_path, arch: str, **values) -> Path:
    from vllm_dllm.tools.make_tiny import make_tiny

    path = Path(make_tiny(arch, tmp_path / arch, seed=7))
    gen_path = path / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.exists() else {}
    gen.update(values)
    gen_path.write_text(json.dumps(gen))
    return path


def test_override_generation_config_filter_reaches_dream_defaults(tmp_path):
    from vllm_dllm.serving.server_config import server_defaults

    path = _tiny_with_generation_config(tmp_path, "dream", top_k=50)
    config = _engine_config(path, override_generation_config={"top_p": 0.9})
    overrides = server_defaults(config).overrides
    assert (overrides["top_k"], overrides["top_p"]) == (50, 0.9)
    # vLLM's own "ignore the checkpoint's generation config" switch is honoured too.
    config = _engine_config(path, generation_config="vllm")
    assert "top_k" not in server_defaults(config).overrides


def test_llada_checkpoint_filter_is_ignored_and_user_filter_fails_at_startup(tmp_path):
    path = _tiny_with_generation_config(tmp_path, "llada", top_k=50)
    config = _engine_config(path)
    # vLLM's default for sampled requests no longer carries the checkpoint's top_k,
    # which LLaDA would have to refuse on every request.
    assert config.model_config.get_diff_sampling_param().get("top_k", 0) in (0, -1)
    # (vLLM wraps the hook's OptionError in its config's ValueError.)
    with pytest.raises(ValueError, match="--override-generation-config sets top_k=40, but LLaDA"):
        _engine_config(path, override_generation_config={"top_k": 40})
