#!/usr/bin/env bash
# Megatron-Bridge cross-check (bench/bridge_crosscheck.py) on a host with Python 3.12, torch and
# transformers but no Megatron: installs the carried wheels (.whl/bridge: megatron-bridge 0.6.2,
# megatron-core 0.19.2, nvidia-modelopt + PuLP 2.9.0, omegaconf + antlr4, hydra-core, rich and its
# parts, pydantic and its parts, datasets + dill + multiprocess; docs/PERFORMANCE.md lists them)
# with --no-deps into
# /tmp/site and runs the check on the CPU (tiny models, gloo; the GPU is hidden): Llama, Qwen2 and
# the MoE families (Qwen3-MoE, Qwen2-MoE, Mixtral: Bridge's stacked MoE layout -> our mcore2hf).
#   bash bench/bridge_crosscheck.sh            (from the repo root; $OUT receives the JSON)
set -euo pipefail
WHL=${WHL:-.whl/bridge}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$WHL"/*.whl
export PYTHONPATH="$PWD:/tmp/site"
export CUDA_VISIBLE_DEVICES=""
export PYTHONUNBUFFERED=1
python3 -c "import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, transformers.__version__)"
python3 bench/bridge_crosscheck.py --out "${OUT:-/tmp/bridge_crosscheck}"
