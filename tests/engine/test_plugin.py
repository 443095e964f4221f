"""Plugin registration: what it changes for our architectures, and that it changes
nothing for any other model."""

from __future__ import annotations

import json
import logging
import os

import pytest
from vllm.engine.arg_utils import EngineArgs

from tests.unit.test_structural_tags import TEXT_ARGUMENT, tool_call_tag
import vllm_dllm
from vllm_dllm.serving import compat, server_config
from vllm_dllm.serving.compat import DEFAULT_BLOCK_SIZE, RESERVED_CPU_ENV, V2_RUNNER_ENV, check_vllm_version
from vllm_dllm.serving.openmp_spin import SMALL_MACHINE_SPIN, SPIN_ENV, WAIT_POLICY_ENV
from vllm_dllm.serving.server_config import CPU_WORKER_CLS, RESOLVED_KEY, SCHEDULER_CLS
from vllm_dllm.serving.structural_tags import bound_whitespace
from vllm_dllm.serving.validation import is_validator


def engine_config(model_dir, **kwargs):
    args = EngineArgs(model=str(model_dir), max_model_len=256, enforce_eager=True, **kwargs)
    return args.create_engine_config()


def _validator(config):
    """The validator class vLLM loads from the config (`module:Class`, as its loader does)."""
    import importlib

    (path,) = config.model_config.logits_processors
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def test_each_engine_validates_against_its_own_defaults(tiny_dirs):
    # vLLM gives validate_params the request alone: two offline engines in one
    # process (LLaDA and Dream here) must not validate against each other's defaults.
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    vllm_dllm.register()
    llada = _validator(engine_config(tiny_dirs("llada"), additional_config={"dllm": {"steps": 8}}))
    dream = _validator(engine_config(tiny_dirs("dream")))
    again = _validator(engine_config(tiny_dirs("llada"), additional_config={"dllm": {"steps": 8}}))
    assert llada is not dream and again is llada  # same defaults, same class
    dream_only = SamplingParams(max_tokens=64, extra_args={"alg": "entropy"})  # Dream: 512 steps by default
    dream.validate_params(dream_only)
    with pytest.raises(VLLMValidationError, match="'alg' is a Dream option"):
        llada.validate_params(dream_only)
    llada.validate_params(SamplingParams(max_tokens=16, extra_args={"remasking": "random"}))
    with pytest.raises(VLLMValidationError, match="'remasking' is a LLaDA option"):
        dream.validate_params(SamplingParams(max_tokens=16, extra_args={"remasking": "random"}))
    # A short Dream request that sets no steps runs the most steps the bound allows
    # rather than being refused for the checkpoint's 512.
    dream.validate_params(SamplingParams(max_tokens=8))
    with pytest.raises(VLLMValidationError, match="steps=512 is more than 8 per generated token"):
        dream.validate_params(SamplingParams(max_tokens=8, extra_args={"steps": 512}))


def test_a_structural_tags_json_whitespace_is_bounded_unless_the_server_allows_it(tiny_dirs):
    """vLLM's tool-call grammars (structural tags) compile without its compact-JSON
    switch: the validator bounds their whitespace, as compact JSON is the default."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    vllm_dllm.register()
    tag = tool_call_tag(TEXT_ARGUMENT)
    for config, expected in (({}, bound_whitespace(tag)), ({"dllm": {"any_whitespace": True}}, tag)):
        validator = _validator(engine_config(tiny_dirs("llada"), additional_config=config))
        params = SamplingParams(max_tokens=64, structured_outputs=StructuredOutputsParams(structural_tag=tag))
        validator.validate_params(params)
        assert params.structured_outputs.structural_tag == expected
    assert bound_whitespace(tag) != tag


def test_register_is_idempotent_and_adds_only_our_architectures():
    from vllm_dllm.families import BY_ARCHITECTURE
    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    before = dict(MODELS_CONFIG_MAP)
    vllm_dllm.register()
    vllm_dllm.register()
    added = set(MODELS_CONFIG_MAP) - set(before)
    ours = set(BY_ARCHITECTURE)
    assert {"LLaDAModelLM", "DreamModel", "LLaDA2MoeModelLM", "LLaDAMoEModelLM"} <= ours
    assert added <= ours
    assert ours <= set(ModelRegistry.get_supported_archs())
    for arch, hook in before.items():
        assert MODELS_CONFIG_MAP[arch] is hook


def test_llada22_checkpoint_is_refused_at_start_up(tmp_path):
    # LLaDA2.2 keeps LLaDA2's architecture and model type; its config names the
    # Levenshtein edit tokens, which the LLaDA2.x rules do not have.
    import shutil

    from vllm_dllm.tools.make_tiny import make_tiny

    vllm_dllm.register()
    model_dir = make_tiny("llada2", tmp_path / "llada2", seed=1)
    config = json.loads((model_dir / "config.json").read_text())
    engine_config(model_dir, dtype="float32")  # the LLaDA2.0/2.1 format starts
    config.update(delete_token_id=310, split_token_id=311)
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(Exception, match="looks like a LLaDA2.2 checkpoint .*delete_token_id, split_token_id"):
        engine_config(model_dir, dtype="float32")
    shutil.rmtree(model_dir)


@pytest.mark.parametrize("found", ["0.31.2", "0.35.0", "1.0.0"])
def test_unsupported_vllm_versions_fail_clearly(found):
    with pytest.raises(RuntimeError, match=f"supports vLLM 0.32.x, 0.33.x and 0.34.x; found vLLM {found}"):
        check_vllm_version(found)


@pytest.mark.parametrize("found", ["0.32.0", "0.32.1+cpu", "0.33.0", "0.33.2", "0.34.0", "0.34.1+cpu"])
def test_supported_vllm_versions_pass(found):
    check_vllm_version(found)


@pytest.mark.parametrize("arch", ["llada", "dream"])
def test_diffusion_models_get_our_worker_scheduler_and_validator(tiny_dirs, arch):
    vllm_dllm.register()
    config = engine_config(
        tiny_dirs(arch), additional_config={"dllm": {"steps": 8, "max_num_logits": 64}}
    )
    assert config.parallel_config.worker_cls == CPU_WORKER_CLS
    assert config.scheduler_config.scheduler_cls == SCHEDULER_CLS
    assert [is_validator(p) for p in config.model_config.logits_processors] == [True]
    assert config.cache_config.enable_prefix_caching is False
    # vLLM's own diffusion path (DiffusionGemma, from 0.33) is for configs with a
    # canvas_length; ours stay out of it.
    assert not getattr(config.model_config, "is_diffusion", False)
    # Our defaults, the same under every supported vLLM (compat.py).
    assert config.cache_config.block_size == DEFAULT_BLOCK_SIZE["cpu"]
    if compat.has_v1_runners():
        assert os.environ[V2_RUNNER_ENV] == "0"
    else:  # vLLM's own runner warm-up would run against ours
        assert config.kernel_config.enable_jit_warmup is False
        assert config.cache_config.enable_extensible_kv_cache is False
    resolved = config.additional_config[RESOLVED_KEY]
    assert resolved["kind"] == arch
    assert resolved["overrides"]["steps"] == 8
    assert resolved["max_num_logits"] == 64


@pytest.mark.parametrize("cpus", [2, 16])
def test_a_small_machine_serves_with_every_core(tiny_dirs, monkeypatch, cpus):
    """vLLM keeps one core from its CPU worker for the engine core; on a 2-core
    machine that halves the compute (benchmarks/results/engine-overhead/)."""
    vllm_dllm.register()
    monkeypatch.setenv(RESERVED_CPU_ENV, "unset")  # records the variable's state, restored after
    monkeypatch.delenv(RESERVED_CPU_ENV)
    monkeypatch.setenv(SPIN_ENV, "unset")
    monkeypatch.delenv(SPIN_ENV)
    monkeypatch.delenv(WAIT_POLICY_ENV, raising=False)
    monkeypatch.setattr(compat.os, "sched_getaffinity", lambda pid: set(range(cpus)))
    engine_config(tiny_dirs("llada"))
    small = cpus <= compat.SMALL_MACHINE_CPUS
    assert os.environ.get(RESERVED_CPU_ENV) == ("0" if small else None)
    # Idle OpenMP threads leave the engine core its core between steps (openmp_spin.py).
    assert os.environ.get(SPIN_ENV) == (str(SMALL_MACHINE_SPIN) if small else None)


def test_a_quantized_kv_cache_is_refused_at_startup(tiny_dirs):
    vllm_dllm.register()
    with pytest.raises(ValueError, match="--kv-cache-dtype fp8 is not supported by vllm-dllm"):
        engine_config(tiny_dirs("llada"), kv_cache_dtype="fp8")
    engine_config(tiny_dirs("llada"), kv_cache_dtype="auto")


@pytest.mark.parametrize("arch", ["llada", "dream", "llada2"])
def test_async_scheduling_asked_for_is_refused_and_off_otherwise(tiny_dirs, arch):
    vllm_dllm.register()
    with pytest.raises(ValueError, match="does not support --async-scheduling: the scheduler prices each denoising"):
        engine_config(tiny_dirs(arch), async_scheduling=True)
    for asked in (None, False):
        config = engine_config(tiny_dirs(arch), async_scheduling=asked)
        assert config.scheduler_config.async_scheduling is False
        assert config.scheduler_config.scheduler_cls == SCHEDULER_CLS


@pytest.mark.parametrize("flag, message", [
    (dict(enable_lora=True), r"does not support LoRA adapters yet \(--enable-lora\)"),
    (dict(enable_prompt_embeds=True), r"does not support prompt embeddings \(--enable-prompt-embeds\)"),
    (dict(logits_processors=["my_package.processors:NoRepeats"]),
     r"does not apply custom logits processors \(--logits-processors my_package.processors:NoRepeats\)"),
    (dict(kv_transfer_config={"kv_connector": "ExampleConnector", "kv_role": "kv_both"}),
     r"does not support KV transfer \(--kv-transfer-config\)"),
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}),
     r"does not support speculative decoding \(--speculative-config\)"),
])
def test_features_the_engine_would_ignore_are_refused_at_startup(tiny_dirs, flag, message):
    vllm_dllm.register()
    with pytest.raises(ValueError, match=message):
        engine_config(tiny_dirs("llada"), **flag)


@pytest.mark.usefixtures("plugin_logs")
def test_installed_logits_processor_plugins_are_named_as_unapplied(tiny_dirs, tmp_path, monkeypatch, caplog):
    vllm_dllm.register()
    with caplog.at_level(logging.WARNING, logger=server_config.logger.name):
        engine_config(tiny_dirs("llada"))
    assert "applies no logits processors" not in caplog.text
    # An installed distribution declaring a logits-processor plugin, as pip leaves it.
    info = tmp_path / "no_repeats-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: no-repeats\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[vllm.logits_processors]\nno_repeats = no_repeats.procs:NoRepeats\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=server_config.logger.name):
        engine_config(tiny_dirs("llada"))
    assert ("applies no logits processors: the installed plugins no_repeats = no_repeats.procs:NoRepeats "
            "(entry-point group vllm.logits_processors) will not change any output") in caplog.text


def test_a_chosen_block_size_is_kept(tiny_dirs):
    vllm_dllm.register()
    config = engine_config(tiny_dirs("llada"), block_size=64)
    assert config.cache_config.block_size == 64


def test_bad_server_options_fail_at_startup(tiny_dirs):
    vllm_dllm.register()
    with pytest.raises(ValueError, match="unknown diffusion option 'stepz'"):
        engine_config(tiny_dirs("llada"), additional_config={"dllm": {"stepz": 8}})


@pytest.mark.usefixtures("plugin_logs")
def test_json_is_compact_by_default_and_the_user_choice_wins(tiny_dirs, caplog):
    """A fixed canvas has no positions to spare for whitespace a JSON grammar allows
    between any two tokens."""
    from vllm.config import StructuredOutputsConfig

    vllm_dllm.register()
    model = tiny_dirs("llada")
    assert engine_config(model).structured_outputs_config.disable_any_whitespace
    chosen = StructuredOutputsConfig(backend="guidance")
    assert engine_config(model, structured_outputs_config=chosen).structured_outputs_config.disable_any_whitespace
    spaced = engine_config(model, additional_config={"dllm": {"any_whitespace": True}})
    assert not spaced.structured_outputs_config.disable_any_whitespace
    compact = StructuredOutputsConfig(backend="xgrammar", disable_any_whitespace=True)
    explicit = engine_config(model, structured_outputs_config=compact, additional_config={"dllm": {"any_whitespace": True}})
    assert explicit.structured_outputs_config.disable_any_whitespace  # vLLM's explicit option wins
    with caplog.at_level(logging.WARNING):
        outlines = engine_config(model, structured_outputs_config=StructuredOutputsConfig(backend="outlines"))
    assert not outlines.structured_outputs_config.disable_any_whitespace  # it has no such option
    assert "cannot leave whitespace out of JSON" in caplog.text
    with pytest.raises(ValueError, match="'any_whitespace' must be true or false"):
        engine_config(model, additional_config={"dllm": {"any_whitespace": "yes"}})


def test_other_models_are_untouched(tmp_path):
    vllm_dllm.register()
    llama = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "num_hidden_layers": 1,
        "vocab_size": 256,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "torch_dtype": "float32",
    }
    (tmp_path / "config.json").write_text(json.dumps(llama))
    config = engine_config(tmp_path, skip_tokenizer_init=True)
    assert config.parallel_config.worker_cls == "vllm.v1.worker.cpu_worker.CPUWorker"
    assert config.scheduler_config.scheduler_cls in (None, "vllm.v1.core.sched.scheduler.Scheduler")
    assert not config.model_config.logits_processors
    assert RESOLVED_KEY not in config.additional_config
    assert not config.structured_outputs_config.disable_any_whitespace


def test_other_models_keep_vllms_cpu_reservation(tmp_path, monkeypatch):
    vllm_dllm.register()
    monkeypatch.setenv(RESERVED_CPU_ENV, "unset")  # records the variable's state, restored after
    monkeypatch.delenv(RESERVED_CPU_ENV)
    monkeypatch.setenv(SPIN_ENV, "unset")
    monkeypatch.delenv(SPIN_ENV)
    monkeypatch.setattr(compat.os, "sched_getaffinity", lambda pid: {0})
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 2,
        "num_hidden_layers": 1, "vocab_size": 256, "max_position_embeddings": 256,
    }))
    engine_config(tmp_path, skip_tokenizer_init=True)
    assert RESERVED_CPU_ENV not in os.environ
    assert SPIN_ENV not in os.environ


def test_diffusion_metrics_only_for_our_architectures(tmp_path, tiny_dirs):
    import prometheus_client

    from vllm_dllm.serving.metrics import DiffusionStatLogger

    vllm_dllm.register()
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 2,
        "num_hidden_layers": 1, "vocab_size": 256, "max_position_embeddings": 256,
    }))
    names = prometheus_client.REGISTRY._names_to_collectors
    # An engine of an earlier test in this process may have registered ours already:
    # what matters is that serving another model registers nothing.
    before = set(names)
    other = DiffusionStatLogger(engine_config(llama, skip_tokenizer_init=True))
    other.log_engine_initialized()
    assert not other.active and set(names) == before
    ours = DiffusionStatLogger(engine_config(tiny_dirs("llada")))
    ours.log_engine_initialized()
    assert ours.active and "vllm:diffusion_num_denoising_steps" in names


def test_kv_gauges_read_zero_once_nothing_runs(tiny_dirs):
    """A step's gauges count what runs after it; a stats report of a step
    that ran nothing (clearing finished or aborted requests) sets 0 when nothing runs."""
    from vllm.v1.metrics.stats import SchedulerStats

    from vllm_dllm.serving.metrics import DiffusionStatLogger, StepStats

    logger = DiffusionStatLogger(engine_config(tiny_dirs("llada")))
    logger.log_engine_initialized()
    step = StepStats(denoising_steps=1, query_tokens=40, kv_slots=17, kv_dense_slots=40)
    logger.record(SchedulerStats(num_running_reqs=1, spec_decoding_stats=step.to_spec_decoding_stats()), None)
    assert logger.gauges["kv_slots"]._value.get() == 17 and logger.gauges["kv_dense_slots"]._value.get() == 40
    logger.record(SchedulerStats(num_running_reqs=1), None)  # no step, still running: unchanged
    assert logger.gauges["kv_slots"]._value.get() == 17
    logger.record(SchedulerStats(num_running_reqs=0), None)
    assert logger.gauges["kv_slots"]._value.get() == 0 and logger.gauges["kv_dense_slots"]._value.get() == 0


def test_the_cuda_extra_asks_for_the_two_newest_supported_releases():
    """`pip install -e ".[cuda]"` takes the newest vLLM the support window has (an
    existing deployment of the release before it keeps its vLLM); the CPU extra stays
    on the newest CPU wheel on the package index."""
    import tomllib
    from pathlib import Path

    from packaging.requirements import Requirement

    extras = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())[
        "project"]["optional-dependencies"]
    (cuda,) = [Requirement(r) for r in extras["cuda"]]
    (low_major, low_minor), (high_major, high_minor) = compat.SUPPORTED
    newest, previous = f"{high_major}.{high_minor - 1}", f"{high_major}.{high_minor - 2}"
    assert cuda.name == "vllm"
    assert cuda.specifier.contains(f"{newest}.0") and cuda.specifier.contains(f"{newest}.3")
    assert cuda.specifier.contains(f"{previous}.0")
    assert not cuda.specifier.contains(f"{high_major}.{high_minor}.0")
    assert not cuda.specifier.contains(f"{high_major}.{high_minor - 3}.0")
    cpu = [Requirement(r) for r in extras["cpu"] if r.startswith("vllm")]
    assert [str(r.specifier) for r in cpu] == [f"=={low_major}.{low_minor}.0"]


@pytest.mark.parametrize("module", ["vllm_dllm.default_model", "vllm_dllm.llada2_model"])
def test_shipped_model_paths_are_model_names_vllm_takes(module):
    """`LLM(model=vllm_dllm.default_model.PATH)`: vLLM's model argument is a str (a
    pathlib.Path failed inside its config code)."""
    import importlib

    path = importlib.import_module(module).PATH
    assert isinstance(path, str) and os.path.isfile(os.path.join(path, "config.json"))
    EngineArgs(model=path, skip_tokenizer_init=True).create_model_config()


def test_every_family_record_names_classes_that_exist_and_a_known_kind():
    # The record is all the registries read: a wrong path or kind would only show
    # when a user loads that family, so each is resolved here.
    from vllm_dllm.decoding.rules import RULES
    from vllm_dllm.families import BY_ARCHITECTURE, FAMILIES, load_class
    from vllm_dllm.options import KINDS

    assert sum(len(f.architectures) for f in FAMILIES) == len(BY_ARCHITECTURE)  # no architecture twice
    for family in FAMILIES:
        assert family.kind in KINDS and family.kind in RULES, family.name
        assert load_class(family.model).__name__ == family.model.rpartition(":")[2]
        assert load_class(family.config).model_type
        if family.tokenizer:
            load_class(family.tokenizer)


def test_a_config_is_served_by_its_first_known_architecture():
    from types import SimpleNamespace

    from vllm_dllm.families import family_of

    assert family_of(SimpleNamespace(architectures=["LlamaForCausalLM"])) is None
    assert family_of(SimpleNamespace(architectures=None)) is None
    moe = family_of(SimpleNamespace(architectures=["Unknown", "LLaDAMoeModelLM"]))
    assert (moe.name, moe.kind, moe.moe) == ("LLaDA-MoE", "llada", True)
    assert family_of(SimpleNamespace(architectures=["DreamModel"])).kind == "dream"
    assert family_of(SimpleNamespace(architectures=["LLaDA2MoeModelLM"])).moe
