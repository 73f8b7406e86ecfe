#!/usr/bin/env bash
# The wheels the GPU check carries: what `python -m launcher` imports beyond the lent GPU machine's
# image (Python 3.12, torch with CUDA, Lightning, matplotlib, rich, jinja2, numpy, pyyaml, but no
# Hydra or OmegaConf). That machine has no network, so they travel with the checkout as an ignored
# folder, and scripts/gpu_check.sh installs them with `pip install --no-index --target`.
#
#   scripts/gpu_wheels.sh            # into .whl/ (ignored by git); about 0.4 MB
#   scripts/gpu_wheels.sh DIR        # into DIR
#
# Each dependency is named with its version (--no-deps: nothing else comes along). W&B (a 20 MB
# wheel) is left out: the check runs the launcher with logger=none. Sweeps' plugins (Slurm,
# Optuna) and the comparison page's plotly are not needed by a training run.
set -euo pipefail
cd "$(dirname "$0")/.."
dest="${1:-.whl}"
mkdir -p "$dest"
py="$(command -v python3 || command -v python)"
# pure-Python wheels: they install on any CPython 3; the platform flags only say which wheels to take
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$dest" \
  hydra-core==1.3.8 omegaconf==2.3.1
# hydra-core pins antlr4-python3-runtime==4.9.*, published only as a source archive: build its wheel
if ! ls "$dest"/antlr4_python3_runtime-4.9.3-*.whl >/dev/null 2>&1; then
  "$py" -m pip wheel -q --no-deps --no-build-isolation -w "$dest" antlr4-python3-runtime==4.9.3 2>/dev/null ||
    "$py" -m pip wheel -q --no-deps -w "$dest" antlr4-python3-runtime==4.9.3
fi
du -sh "$dest" | cut -f1 | sed "s|^|$dest: |"
ls "$dest"
