#!/usr/bin/env bash
# Make a Python 3.12 environment with the GPU host's software, to rehearse bench/gpu_check.sh on a CPU:
#
#   bench/rehearsal_env.sh VENV [PYTHON3.12]        then, from the repository root:
#   PATH=VENV/bin:$PATH bench/gpu_check.sh --rehearse --archive OUT/call.tar.gz /tmp/rehearsal host probe tests
#
# The host's image has torch 2.11 (the CUDA 13.0 build, which imports and runs on a CPU), triton 3.6,
# transformers 5.17 and the packages below; triton 3.6's interpreter needs numpy < 2.4. What the image lacks comes
# as wheels in .whl/ (../shared/device/wheels.sh, run with this environment's python so they are cp312), installed
# by gpu_check.sh into /tmp/site exactly as on the host. About 4 GB of downloads, mostly torch's CUDA libraries.
set -euo pipefail
venv=${1:?usage: bench/rehearsal_env.sh VENV [PYTHON3.12]}
python=${2:-$(command -v python3.12 || echo "$HOME/.pyenv/versions/3.12.1/bin/python")}
cd "$(dirname "$0")/.."
"$python" -m venv "$venv"
"$venv/bin/pip" install -q torch==2.11.0 triton==3.6.0 transformers==5.17.0 "numpy<2.4" \
  aiohttp uvloop httpx requests psutil tqdm matplotlib jinja2 msgpack pytest hypothesis nvidia-ml-py pyyaml
PATH=$venv/bin:$PATH ../shared/device/wheels.sh
cp ../shared/device/host_check.py .whl/
"$venv/bin/python" -c 'import sys, torch, triton, transformers, numpy
print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__,
      "transformers", transformers.__version__, "numpy", numpy.__version__)'
