# Set-up is idempotent: the venv is rebuilt only when pyproject.toml changes.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8000
TINY_MODEL := .cache/tiny-model

.PHONY: setup test vllm-surface serve serve-llada2 serve-tiny bench clean

setup: $(STAMP)

# scripts/install.sh is the one install recipe (also for users outside make): CUDA
# machines get vLLM's CUDA build, everything else the CPU build with its torch pin
# and wheel clean-ups.
$(STAMP): pyproject.toml scripts/install.sh
	PYTHON=$(PYTHON) scripts/install.sh auto --venv $(VENV) --extras test,eval
	touch $(STAMP)

test: setup
	# The vLLM surface check (vllm_dllm/serving/vllm_surface/) against the installed vLLM;
	# tests/unit/test_vllm_surface.py runs it too.
	$(BIN)/python -m vllm_dllm.tools.vllm_surface_check
	$(BIN)/python -m pytest -q tests

# Check another vLLM release without installing it: make vllm-surface VLLM=0.34.0
vllm-surface: setup
	$(BIN)/python -m vllm_dllm.tools.vllm_surface_check --release $(VLLM) \
		--report docs/vllm-$(basename $(VLLM))-surface.md

# The embedded default: the small task model trained by lab.train.
serve: setup
	VLLM_PLUGINS=dllm $(BIN)/vllm serve $$($(BIN)/python -m vllm_dllm.default_model) --served-model-name vllm-dllm-task \
		--host $(HOST) --port $(PORT) \
		--max-model-len 512 --kv-cache-memory-bytes 268435456 --gpu-memory-utilization 0.3

# The shipped LLaDA2-format task model (block diffusion, vllm_dllm/llada2_model).
serve-llada2: setup
	VLLM_PLUGINS=dllm $(BIN)/vllm serve $$($(BIN)/python -m vllm_dllm.llada2_model) --served-model-name vllm-dllm-llada2 \
		--host $(HOST) --port $(PORT) \
		--max-model-len 512 --kv-cache-memory-bytes 268435456 --gpu-memory-utilization 0.3

# A random-weight tiny LLaDA, for plumbing checks without the trained model.
$(TINY_MODEL)/config.json: | setup
	$(BIN)/python -m vllm_dllm.tools.make_tiny --arch llada --out $(TINY_MODEL) --seed 0

serve-tiny: setup $(TINY_MODEL)/config.json
	VLLM_PLUGINS=dllm $(BIN)/vllm serve $(TINY_MODEL) --host $(HOST) --port $(PORT) \
		--max-model-len 512 --kv-cache-memory-bytes 268435456 --gpu-memory-utilization 0.3

# The scheduling benchmark (minutes to an hour on a 2-core CPU); see benchmarks/README.md.
bench: setup
	scripts/install.sh auto --venv $(VENV) --extras test,bench
	$(BIN)/python benchmarks/serve_sweep.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .cache
