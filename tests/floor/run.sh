#!/usr/bin/env bash
# The core subset of the suite on the declared floor (README "Tested versions"): a fresh virtual environment in a
# temporary directory with torch, transformers and accelerate at the lowest versions pyproject.toml admits, the
# project installed from this tree, then the tests listed in tests/floor/subset.txt. The README's test command runs
# it after the full suite; alone: bash tests/floor/run.sh (HFZERO_FLOOR_KEEP=1 keeps the environment and says where).
set -euo pipefail
cd "$(dirname "$0")/../.."

# Keep equal to pyproject.toml's lower bounds (tests/test_torch_floor.py checks).
FLOOR_TORCH=2.10.0
FLOOR_TRANSFORMERS=5.17.0
FLOOR_ACCELERATE=1.10.1

root=$(mktemp -d "${TMPDIR:-/tmp}/hfzero-floor.XXXXXX")
if [ "${HFZERO_FLOOR_KEEP:-0}" = 1 ]; then
  echo "floor: environment kept in $root/venv"
else
  trap 'rm -rf "$root"' EXIT
fi
python -m venv "$root/venv"
py="$root/venv/bin/python"
pip_install() { "$py" -m pip install -q --disable-pip-version-check "$@"; }

start=$SECONDS
# torch's PyPI wheel for Linux x86_64 is its CUDA build, which names ~3 GB of nvidia-* libraries among its
# requirements; it imports and runs on the CPU without them (they load only when CUDA is used), so on a machine
# without a GPU take the wheel alone and its pure-Python requirements.
if command -v nvidia-smi >/dev/null 2>&1; then
  pip_install "torch==$FLOOR_TORCH"
else
  pip_install --no-deps "torch==$FLOOR_TORCH"
  pip_install filelock "typing-extensions>=4.10.0" "sympy>=1.13.3" "networkx>=2.5.1" jinja2 "fsspec>=0.8.5"
fi
echo "floor: torch $FLOOR_TORCH installed in $((SECONDS - start)) s"

start=$SECONDS
pip_install -e ".[dev]" "torch==$FLOOR_TORCH" "transformers==$FLOOR_TRANSFORMERS" "accelerate==$FLOOR_ACCELERATE"
"$py" -c "import torch, transformers, accelerate; print('floor: torch', torch.__version__, '| transformers', \
transformers.__version__, '| accelerate', accelerate.__version__)"
echo "floor: project and its requirements installed in $((SECONDS - start)) s"

mapfile -t tests < <(sed -e 's/#.*//' -e 's/[[:space:]]*$//' tests/floor/subset.txt | grep -v '^$')
start=$SECONDS
"$py" -m pytest -q -p no:cacheprovider "${tests[@]}"
echo "floor: subset ran in $((SECONDS - start)) s"
