"""Tiny random checkpoints (vllm_dllm.tools.make_tiny) follow the real HF file
format of LLaDA-8B / Dream-7B (MODEL_SPEC.md sections 1, 1b, 2, 5), and the
config / tokenizer classes in vllm_dllm.configs load them with and without
trust_remote_code. Fast: no vLLM engine."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

from vllm_dllm.configs import DreamConfig, DreamTokenizer, LLaDAConfig
from vllm_dllm.families import register_hf_classes
from vllm_dllm.tools import make_tiny as mt

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]

# Sizes per variant: the real-vocab ones keep the hidden size tiny (the
# embedding and LM head dominate).
SIZES = {
    ("llada", "small"): dict(hidden=64, layers=2, heads=2, intermediate=128),
    ("llada", "real"): dict(hidden=32, layers=2, heads=2, intermediate=64),
    ("dream", "small"): dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128),
    ("dream", "real"): dict(hidden=32, layers=2, heads=4, kv_heads=2, intermediate=64),
}
VARIANTS = list(SIZES)
IDS = [f"{a}-{v}" for a, v in VARIANTS]

# Special ids: real ones from MODEL_SPEC, small ones chosen by make_tiny.
EXPECTED_IDS = {
    ("llada", "real"): dict(bos=126080, eos=126081, mask=126336, eot=126348, vocab=126464, tok_len=126349),
    ("llada", "small"): dict(bos=296, eos=297, mask=298, eot=303, vocab=320, tok_len=304),
    ("dream", "real"): dict(bos=151665, eos=151643, mask=151666, eot=151645, vocab=152064, tok_len=151667),
    ("dream", "small"): dict(bos=300, eos=296, mask=299, eot=298, vocab=320, tok_len=301),
}
EOT_TOKEN = {"llada": "<|eot_id|>", "dream": "<|im_end|>"}

# Every key of the real LLaDA-8B-Instruct config.json (MODEL_SPEC 1).
LLADA_REAL_KEYS = {
    "architectures", "auto_map", "model_type",
    "d_model", "n_heads", "n_kv_heads", "n_layers", "mlp_hidden_size", "mlp_ratio",
    "vocab_size", "embedding_size",
    "activation_type", "block_type", "block_group_size", "layer_norm_type", "rms_norm_eps",
    "layer_norm_with_affine", "bias_for_layer_norm",
    "rope", "rope_theta", "rope_full_precision", "alibi", "alibi_bias_max", "max_sequence_length",
    "include_bias", "include_qkv_bias", "attention_layer_norm", "attention_layer_norm_with_affine",
    "input_emb_norm", "scale_logits", "weight_tying", "flash_attention", "multi_query_attention",
    "mask_token_id", "eos_token_id", "pad_token_id",
    "attention_dropout", "residual_dropout", "embedding_dropout",
    "init_device", "init_fn", "init_std", "init_cutoff_factor", "precision", "use_cache",
}  # fmt: skip
LLADA_SWITCHES = {
    "activation_type": "silu", "block_type": "llama", "block_group_size": 1, "layer_norm_type": "rms",
    "rms_norm_eps": 1e-05, "layer_norm_with_affine": True, "bias_for_layer_norm": False, "rope": True,
    "rope_theta": 500000.0, "rope_full_precision": True, "alibi": False, "include_bias": False,
    "include_qkv_bias": False, "attention_layer_norm": False, "input_emb_norm": False,
    "scale_logits": False, "weight_tying": False, "flash_attention": False,
    "multi_query_attention": None, "attention_dropout": 0.0, "residual_dropout": 0.0,
    "embedding_dropout": 0.0, "use_cache": False,
}  # fmt: skip
DREAM_REAL_KEYS = {
    "architectures", "auto_map", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "rms_norm_eps", "rope_theta", "rope_scaling",
    "max_position_embeddings", "hidden_act", "vocab_size", "tie_word_embeddings", "sliding_window",
    "use_sliding_window", "max_window_layers", "use_mrope", "attention_dropout", "use_cache",
    "torch_dtype", "mask_token_id", "bos_token_id", "eos_token_id", "pad_token_id",
}  # fmt: skip
DREAM_SWITCHES = {
    "hidden_act": "silu", "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "rope_scaling": None,
    "tie_word_embeddings": False, "sliding_window": None, "use_sliding_window": False,
    "use_mrope": False, "attention_dropout": 0.0, "use_cache": True,
}  # fmt: skip

LLADA_FILES = [
    "config.json", "generation_config.json", "configuration_llada.py", "model.safetensors",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
]  # fmt: skip
DREAM_FILES = [
    "config.json", "generation_config.json", "configuration_dream.py", "model.safetensors",
    "vocab.json", "merges.txt", "tokenization_dream.py", "tokenizer_config.json",
    "special_tokens_map.json", "added_tokens.json",
]  # fmt: skip


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {
        (arch, vocab): mt.make_tiny(arch, root / f"{arch}-{vocab}", vocab=vocab, seed=0, **SIZES[(arch, vocab)])
        for arch, vocab in VARIANTS
    }


@pytest.fixture(scope="module")
def registered():
    register_hf_classes()
    register_hf_classes()  # idempotent
    return True


def _load_json(path):
    return json.loads(pathlib.Path(path).read_text(encoding="utf-8"))


# ---------------------------------------------------------------------------
# files and config.json
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
def test_files_exist(ckpts, variant):
    d = ckpts[variant]
    arch = variant[0]
    for name in LLADA_FILES if arch == "llada" else DREAM_FILES:
        assert (d / name).is_file(), name
    # no fake modeling code
    for name in ("modeling_llada.py", "modeling_dream.py", "generation_utils.py"):
        assert not (d / name).exists()
    if arch == "llada":
        assert not (d / "vocab.json").exists()
        assert (d / "configuration_llada.py").read_text() == (REPO_ROOT / "vllm_dllm/configs/llada.py").read_text()
    else:
        assert not (d / "tokenizer.json").exists()
        assert (d / "configuration_dream.py").read_text() == (REPO_ROOT / "vllm_dllm/configs/dream.py").read_text()
        assert (d / "tokenization_dream.py").read_text() == (
            REPO_ROOT / "vllm_dllm/configs/dream_tokenizer.py"
        ).read_text()


@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
def test_config_json_faithful(ckpts, variant):
    arch, vocab = variant
    cfg = _load_json(ckpts[variant] / "config.json")
    exp = EXPECTED_IDS[variant]
    sz = SIZES[variant]
    if arch == "llada":
        assert LLADA_REAL_KEYS <= set(cfg), LLADA_REAL_KEYS - set(cfg)
        for k, v in LLADA_SWITCHES.items():
            assert cfg[k] == v, k
        assert cfg["architectures"] == ["LLaDAModelLM"] and cfg["model_type"] == "llada"
        assert cfg["auto_map"] == {
            "AutoConfig": "configuration_llada.LLaDAConfig",
            "AutoModel": "modeling_llada.LLaDAModelLM",
            "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM",
        }
        assert (cfg["d_model"], cfg["n_heads"], cfg["n_kv_heads"], cfg["n_layers"], cfg["mlp_hidden_size"]) == (
            sz["hidden"], sz["heads"], sz["heads"], sz["layers"], sz["intermediate"],
        )  # fmt: skip
        assert cfg["vocab_size"] == cfg["embedding_size"] == exp["vocab"]
        assert cfg["mask_token_id"] == exp["mask"]
        assert cfg["eos_token_id"] == cfg["pad_token_id"] == exp["eos"]
        assert "eot_token_id" not in cfg
        assert cfg["max_sequence_length"] == 512
        gen = _load_json(ckpts[variant] / "generation_config.json")
        assert (gen["bos_token_id"], gen["eos_token_id"]) == (exp["bos"], exp["eos"])
    else:
        assert DREAM_REAL_KEYS <= set(cfg), DREAM_REAL_KEYS - set(cfg)
        for k, v in DREAM_SWITCHES.items():
            assert cfg[k] == v, k
        assert cfg["architectures"] == ["DreamModel"] and cfg["model_type"] == "Dream"
        assert cfg["auto_map"] == {
            "AutoConfig": "configuration_dream.DreamConfig",
            "AutoModel": "modeling_dream.DreamModel",
        }
        assert cfg["vocab_size"] == exp["vocab"]
        assert cfg["mask_token_id"] == exp["mask"]
        # real Dream: bos_token_id = eos = pad = <|endoftext|> in config.json
        assert cfg["bos_token_id"] == cfg["eos_token_id"] == cfg["pad_token_id"] == exp["eos"]
        assert cfg["num_key_value_heads"] == sz["kv_heads"]
        gen = _load_json(ckpts[variant] / "generation_config.json")
        assert gen["alg"] == "origin" and gen["steps"] == 512 and gen["eps"] == 0.001
        assert gen["temperature"] == 0.0 and gen["top_p"] is None and gen["top_k"] is None
        assert gen["eos_token_id"] == exp["eos"] and gen["mask_token_id"] is None
    if vocab == "small":
        real = EXPECTED_IDS[(arch, "real")]
        for k in ("bos", "eos", "mask", "eot"):
            assert exp[k] != real[k]


# ---------------------------------------------------------------------------
# config / tokenizer classes
# ---------------------------------------------------------------------------


def test_config_defaults_are_real_models():
    c = LLaDAConfig()
    assert (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.num_hidden_layers) == (4096, 32, 32, 32)
    assert (c.intermediate_size, c.head_dim, c.max_position_embeddings, c.vocab_size) == (12288, 128, 4096, 126464)
    assert c.rope and c.rope_theta == 500000.0 and c.block_type == "llama" and not c.weight_tying
    assert not c.tie_word_embeddings and c.use_cache is False
    assert (c.mask_token_id, c.eos_token_id, c.pad_token_id) == (126336, 126081, 126081)
    assert LLaDAConfig(n_kv_heads=None, n_heads=4).num_key_value_heads == 4
    assert LLaDAConfig(mlp_hidden_size=None, d_model=16).intermediate_size == 64
    assert LLaDAConfig(eot_token_id=7).eot_token_id == 7
    rt = LLaDAConfig(**LLaDAConfig(d_model=64, n_heads=4).to_dict())
    assert rt.d_model == 64 and rt.head_dim == 16
    d = DreamConfig()
    assert (d.hidden_size, d.num_attention_heads, d.num_key_value_heads, d.num_hidden_layers) == (3584, 28, 4, 28)
    assert (d.intermediate_size, d.head_dim, d.vocab_size, d.max_position_embeddings) == (18944, 128, 152064, 131072)
    assert (d.mask_token_id, d.bos_token_id, d.eos_token_id, d.pad_token_id) == (151666, 151643, 151643, 151643)
    assert d.rope_theta == 1000000.0 and d.rms_norm_eps == 1e-6 and not d.tie_word_embeddings and d.use_cache


@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
def test_config_via_registration(ckpts, registered, variant):
    from transformers import AutoConfig

    arch, _ = variant
    cfg = AutoConfig.from_pretrained(ckpts[variant], trust_remote_code=False, local_files_only=True)
    raw = _load_json(ckpts[variant] / "config.json")
    sz = SIZES[variant]
    assert type(cfg) is (LLaDAConfig if arch == "llada" else DreamConfig)
    assert cfg.hidden_size == sz["hidden"] and cfg.num_hidden_layers == sz["layers"]
    assert cfg.num_attention_heads == sz["heads"]
    assert cfg.num_key_value_heads == sz.get("kv_heads", sz["heads"])
    assert cfg.intermediate_size == sz["intermediate"]
    assert cfg.head_dim == sz["hidden"] // sz["heads"]
    assert cfg.max_position_embeddings == 512
    assert cfg.vocab_size == raw["vocab_size"]
    assert cfg.mask_token_id == raw["mask_token_id"] and cfg.eos_token_id == raw["eos_token_id"]
    assert cfg.pad_token_id == raw["pad_token_id"]
    assert cfg.tie_word_embeddings is False
    assert cfg.use_cache is raw["use_cache"]
    assert cfg.architectures == raw["architectures"]


@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
def test_tokenizer_via_registration(ckpts, registered, variant):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    arch, _ = variant
    exp = EXPECTED_IDS[variant]
    tok = AutoTokenizer.from_pretrained(ckpts[variant], trust_remote_code=False, local_files_only=True)
    raw = _load_json(ckpts[variant] / "config.json")
    if arch == "dream":
        assert type(tok) is DreamTokenizer
        assert tok.mask_token == "<|mask|>" and tok.mask_token_id == raw["mask_token_id"]
        assert tok.bos_token == "<|beginoftext|>"
        assert tok.unk_token == "<|endoftext|>"
    else:
        assert isinstance(tok, PreTrainedTokenizerFast)
        assert tok.convert_tokens_to_ids("<|mdm_mask|>") == raw["mask_token_id"]
        assert tok.bos_token == "<|startoftext|>"
    assert tok.eos_token == "<|endoftext|>" and tok.pad_token == "<|endoftext|>"
    assert tok.eos_token_id == raw["eos_token_id"] == exp["eos"]
    assert tok.pad_token_id == raw["pad_token_id"]
    assert tok.bos_token_id == exp["bos"]
    assert tok.convert_tokens_to_ids(EOT_TOKEN[arch]) == exp["eot"]
    assert len(tok) == exp["tok_len"]
    # encoding with the default add_special_tokens adds nothing (add_bos false)
    assert tok.encode("hi") == tok.encode("hi", add_special_tokens=False)


@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
def test_text_round_trip(ckpts, registered, variant):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpts[variant], local_files_only=True)
    for text in ("hello world 123", "  Héllo,\twörld! ✓ 日本 \n\n42 "):
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
        assert max(ids) < EXPECTED_IDS[variant]["vocab"]
    ids = tok.encode("hello world", add_special_tokens=False)
    assert len(ids) < len("hello world")  # merges are in effect
    # special tokens in text map to their ids, and are skipped on decode
    arch = variant[0]
    exp = EXPECTED_IDS[variant]
    text = f"{tok.eos_token}hi{EOT_TOKEN[arch]}"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[0] == exp["eos"] and ids[-1] == exp["eot"]
    assert tok.decode(ids, skip_special_tokens=True) == "hi"


@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
def test_chat_template(ckpts, registered, variant):
    from transformers import AutoTokenizer

    arch, _ = variant
    exp = EXPECTED_IDS[variant]
    tok = AutoTokenizer.from_pretrained(ckpts[variant], local_files_only=True)
    msgs = [{"role": "user", "content": "  What is 2+2? \n"}]
    if arch == "llada":
        expected = (
            "<|startoftext|><|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n"
        )
        for agp in (True, False):  # the assistant header is always appended
            assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=agp) == expected
        multi = [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "Bye"},
        ]
        out = tok.apply_chat_template(multi, tokenize=False)
        assert out.count("<|startoftext|>") == 1 and out.startswith("<|startoftext|><|start_header_id|>system")
        assert out.endswith(
            "<|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
        )
        ids = tok.encode(expected, add_special_tokens=False)
        assert ids[0] == exp["bos"] and exp["eot"] in ids
        hdr = tok.convert_tokens_to_ids(["<|start_header_id|>", "<|end_header_id|>"])
        assert ids[1] == hdr[0] and hdr[1] in ids
    else:
        expected = (
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
            "<|im_start|>user\n  What is 2+2? \n<|im_end|>\n<|im_start|>assistant\n"
        )
        assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == expected
        assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False) == expected[
            : -len("<|im_start|>assistant\n")
        ]
        sys_msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
        assert tok.apply_chat_template(sys_msgs, tokenize=False, add_generation_prompt=True) == (
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        )
        ids = tok.encode(expected, add_special_tokens=False)
        assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>") and exp["eot"] in ids
        assert exp["bos"] not in ids  # no bos for Dream


def test_generation_config_loads(ckpts):
    from transformers import GenerationConfig

    g = GenerationConfig.from_pretrained(ckpts[("dream", "small")], local_files_only=True)
    assert g.eos_token_id == EXPECTED_IDS[("dream", "small")]["eos"]
    assert g.temperature == 0.0
    # NB: the real file says "_from_model_config": true, so a plain
    # GenerationConfig keeps only its standard keys and silently drops Dream's
    # alg / steps / eps / alg_temp: read those from the JSON itself.
    raw = _load_json(ckpts[("dream", "small")] / "generation_config.json")
    assert raw["_from_model_config"] is True and raw["alg"] == "origin" and raw["steps"] == 512
    g = GenerationConfig.from_pretrained(ckpts[("llada", "real")], local_files_only=True)
    assert (g.bos_token_id, g.eos_token_id) == (126080, 126081)


# ---------------------------------------------------------------------------
# trust_remote_code in a clean process (no registration in effect)
# ---------------------------------------------------------------------------

_REMOTE_SCRIPT = textwrap.dedent(
    r"""
    import json, sys
    from transformers import AutoConfig, AutoTokenizer
    out = {}
    for d in sys.argv[1:]:
        r = {}
        try:
            AutoConfig.from_pretrained(d, trust_remote_code=False, local_files_only=True)
            r["plain_config"] = "loaded"
        except Exception as e:
            r["plain_config"] = type(e).__name__
        c = AutoConfig.from_pretrained(d, trust_remote_code=True, local_files_only=True)
        t = AutoTokenizer.from_pretrained(d, trust_remote_code=True, local_files_only=True)
        r.update(
            config_class=type(c).__name__, config_module=type(c).__module__,
            tok_class=type(t).__name__, tok_module=type(t).__module__,
            hidden=c.hidden_size, heads=c.num_attention_heads, kv=c.num_key_value_heads,
            layers=c.num_hidden_layers, inter=c.intermediate_size, head_dim=c.head_dim,
            mask=c.mask_token_id, eos=c.eos_token_id, tie=c.tie_word_embeddings,
            tok_eos=t.eos_token_id, tok_bos=t.bos_token_id, tok_mask=t.mask_token_id,
            eot=t.convert_tokens_to_ids("<|eot_id|>" if "llada" in d else "<|im_end|>"),
            rt=t.decode(t.encode("hello world 123", add_special_tokens=False)),
        )
        out[d] = r
    print("RESULT=" + json.dumps(out))
    """
)

_REGISTERED_REMOTE_SCRIPT = textwrap.dedent(
    r"""
    import json, sys
    from transformers import AutoConfig, AutoTokenizer
    from vllm_dllm.families import register_hf_classes
    register_hf_classes()
    out = {}
    for d in sys.argv[1:]:
        c = AutoConfig.from_pretrained(d, trust_remote_code=True, local_files_only=True)
        t = AutoTokenizer.from_pretrained(d, trust_remote_code=True, local_files_only=True)
        out[d] = dict(config_module=type(c).__module__, tok_module=type(t).__module__,
                      mask=c.mask_token_id, tok_eos=t.eos_token_id)
    print("RESULT=" + json.dumps(out))
    """
)


def _run(script, args, tmp_path, pythonpath=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"), TOKENIZERS_PARALLELISM="false")
    env.pop("PYTHONPATH", None)
    if pythonpath:
        env["PYTHONPATH"] = str(pythonpath)
    proc = subprocess.run(
        [sys.executable, "-c", script, *map(str, args)],
        cwd=tmp_path,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT=")][-1]
    return json.loads(line[len("RESULT=") :])


def test_trust_remote_code_clean_process(ckpts, tmp_path):
    dirs = [ckpts[v] for v in VARIANTS]
    res = _run(_REMOTE_SCRIPT, dirs, tmp_path)
    for variant in VARIANTS:
        arch, _ = variant
        r = res[str(ckpts[variant])]
        exp = EXPECTED_IDS[variant]
        sz = SIZES[variant]
        # no registration: the plain load must fail, so the remote code was really used
        assert r["plain_config"] != "loaded"
        assert r["config_module"].startswith("transformers_modules.")
        assert r["config_module"].endswith("configuration_llada" if arch == "llada" else "configuration_dream")
        assert r["config_class"] == ("LLaDAConfig" if arch == "llada" else "DreamConfig")
        assert (r["hidden"], r["heads"], r["kv"], r["layers"], r["inter"], r["head_dim"]) == (
            sz["hidden"], sz["heads"], sz.get("kv_heads", sz["heads"]), sz["layers"], sz["intermediate"],
            sz["hidden"] // sz["heads"],
        )  # fmt: skip
        assert (r["mask"], r["eos"], r["tie"]) == (exp["mask"], exp["eos"], False)
        assert (r["tok_eos"], r["tok_bos"], r["eot"]) == (exp["eos"], exp["bos"], exp["eot"])
        assert r["rt"] == "hello world 123"
        if arch == "dream":
            assert r["tok_class"] == "DreamTokenizer"
            assert r["tok_module"].startswith("transformers_modules.")
            assert r["tok_mask"] == exp["mask"]
        else:
            assert r["tok_module"].startswith("transformers.")


def test_registration_with_trust_remote_code(ckpts, tmp_path):
    """Both switches on. transformers 5: AutoConfig treats a registered config
    class from outside the transformers package as "explicit local code" that
    wins over the folder's auto_map (4.x preferred the remote code).
    AutoTokenizer does the opposite here: since DreamConfig is registered in
    TOKENIZER_MAPPING, it is not "explicit" local code and the folder's
    tokenization_dream.py is used. The sources are identical, so any mix works."""
    import transformers

    dirs = [ckpts[("llada", "small")], ckpts[("dream", "small")]]
    res = _run(_REGISTERED_REMOTE_SCRIPT, dirs, tmp_path, pythonpath=REPO_ROOT)
    r = res[str(dirs[1])]
    if int(transformers.__version__.split(".")[0]) >= 5:
        assert r["config_module"] == "vllm_dllm.configs.dream"
        assert res[str(dirs[0])]["config_module"] == "vllm_dllm.configs.llada"
    assert r["config_module"].endswith("dream")
    assert r["tok_module"].endswith("tokenization_dream") or r["tok_module"] == "vllm_dllm.configs.dream_tokenizer"
    assert r["tok_eos"] == EXPECTED_IDS[("dream", "small")]["eos"]
    assert r["mask"] == EXPECTED_IDS[("dream", "small")]["mask"]
    assert res[str(dirs[0])]["mask"] == EXPECTED_IDS[("llada", "small")]["mask"]


# ---------------------------------------------------------------------------
# weights
# ---------------------------------------------------------------------------


def _expected_shapes(arch, vocab_size, hidden, layers, heads, intermediate, kv_heads=None):
    kv_heads = kv_heads or heads
    hd = hidden // heads
    if arch == "llada":
        p = "model.transformer."
        shapes = {p + "wte.weight": (vocab_size, hidden), p + "ln_f.weight": (hidden,),
                  p + "ff_out.weight": (vocab_size, hidden)}  # fmt: skip
        for i in range(layers):
            b = f"{p}blocks.{i}."
            shapes.update({
                b + "attn_norm.weight": (hidden,), b + "ff_norm.weight": (hidden,),
                b + "q_proj.weight": (heads * hd, hidden), b + "k_proj.weight": (kv_heads * hd, hidden),
                b + "v_proj.weight": (kv_heads * hd, hidden), b + "attn_out.weight": (hidden, heads * hd),
                b + "ff_proj.weight": (intermediate, hidden), b + "up_proj.weight": (intermediate, hidden),
                b + "ff_out.weight": (hidden, intermediate),
            })  # fmt: skip
        assert len(shapes) == 3 + 9 * layers
    else:
        shapes = {"model.embed_tokens.weight": (vocab_size, hidden), "lm_head.weight": (vocab_size, hidden),
                  "model.norm.weight": (hidden,)}  # fmt: skip
        for i in range(layers):
            b = f"model.layers.{i}."
            shapes.update({
                b + "input_layernorm.weight": (hidden,), b + "post_attention_layernorm.weight": (hidden,),
                b + "self_attn.q_proj.weight": (heads * hd, hidden), b + "self_attn.q_proj.bias": (heads * hd,),
                b + "self_attn.k_proj.weight": (kv_heads * hd, hidden), b + "self_attn.k_proj.bias": (kv_heads * hd,),
                b + "self_attn.v_proj.weight": (kv_heads * hd, hidden), b + "self_attn.v_proj.bias": (kv_heads * hd,),
                b + "self_attn.o_proj.weight": (hidden, heads * hd),
                b + "mlp.gate_proj.weight": (intermediate, hidden), b + "mlp.up_proj.weight": (intermediate, hidden),
                b + "mlp.down_proj.weight": (hidden, intermediate),
            })  # fmt: skip
        assert len(shapes) == 3 + 12 * layers
    return shapes


@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
def test_weights_names_and_shapes(ckpts, variant):
    import torch
    from safetensors.torch import load_file

    arch, _ = variant
    w = load_file(str(ckpts[variant] / "model.safetensors"))
    shapes = _expected_shapes(arch, EXPECTED_IDS[variant]["vocab"], **SIZES[variant])
    assert {k: tuple(v.shape) for k, v in w.items()} == shapes
    assert all(v.dtype == torch.float32 for v in w.values())
    emb, head = (
        ("model.transformer.wte.weight", "model.transformer.ff_out.weight")
        if arch == "llada"
        else ("model.embed_tokens.weight", "lm_head.weight")
    )
    hidden = SIZES[variant]["hidden"]
    assert abs(w[emb].std().item() - 0.02) < 0.002
    assert abs(w[head].std().item() - 3.0 / hidden**0.5) < 0.05 * 3.0 / hidden**0.5
    norm = w["model.transformer.ln_f.weight" if arch == "llada" else "model.norm.weight"]
    assert (norm - 1).abs().max().item() < 0.2 and (norm != 1).any()
    if arch == "dream":
        b = w["model.layers.0.self_attn.q_proj.bias"]
        assert b.abs().max().item() < 0.2 and (b != 0).any()


def test_seed_determinism_and_dtype(tmp_path):
    import torch
    from safetensors.torch import load_file

    def digest(d):
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}

    kw = dict(vocab="small", hidden=32, layers=1, heads=2, intermediate=64)
    for arch in ("llada", "dream"):
        a = mt.make_tiny(arch, tmp_path / f"{arch}-a", seed=0, **kw)
        b = mt.make_tiny(arch, tmp_path / f"{arch}-b", seed=0, **kw)
        c = mt.make_tiny(arch, tmp_path / f"{arch}-c", seed=1, **kw)
        da, db, dc = digest(a), digest(b), digest(c)
        assert da == db
        assert da["model.safetensors"] != dc["model.safetensors"]
        wa, wc = load_file(str(a / "model.safetensors")), load_file(str(c / "model.safetensors"))
        assert wa.keys() == wc.keys() and all(not torch.equal(wa[k], wc[k]) for k in wa)
        for name in da:  # only the weights (and the recorded seed) depend on the seed
            if name not in ("model.safetensors", "make_tiny.json"):
                assert da[name] == dc[name], name
        # regenerating into an existing folder gives the same bytes
        mt.make_tiny(arch, a, seed=0, **kw)
        assert digest(a) == db


def test_cli_bfloat16(tmp_path):
    import torch
    from safetensors.torch import load_file

    out = tmp_path / "dream-bf16"
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_dllm.tools.make_tiny", "--arch", "dream", "--out", str(out),
         "--hidden", "32", "--layers", "1", "--heads", "4", "--kv-heads", "1", "--intermediate", "48",
         "--dtype", "bfloat16", "--seed", "3", "--max-len", "256"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip().splitlines()[-1] == str(out)
    w = load_file(str(out / "model.safetensors"))
    assert all(v.dtype == torch.bfloat16 for v in w.values())
    assert tuple(w["model.layers.0.self_attn.k_proj.weight"].shape) == (8, 32)
    cfg = _load_json(out / "config.json")
    assert cfg["torch_dtype"] == "bfloat16" and cfg["num_key_value_heads"] == 1
    assert cfg["max_position_embeddings"] == 256


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError):
        mt.make_tiny("gpt2", tmp_path / "x")
    with pytest.raises(ValueError):
        mt.make_tiny("llada", tmp_path / "x", hidden=30, heads=4)
    with pytest.raises(ValueError):
        mt.make_tiny("dream", tmp_path / "x", heads=4, kv_heads=3, hidden=32)
