#!/usr/bin/env bash
# The GPU check, in parts that each fit one short call and write $OUT/<part>.json:
#   env       CUDA, NCCL at world size 1, the launcher's imports, seconds
#   flagship  python -m launcher on CUDA (ddp, fsdp, gpipe, 1f1b, fslpp; float32 and bf16-mixed)
#             against strategy=single, predicted beside measured; the engine at W=4 on the one GPU
#   overhead  the engine against plain PyTorch on a 1 B Llama, with MFU
#   benchmark the transformer pair(s) under NCCL
#
#   scripts/gpu_check.sh --parts env                  # one part per call on the GPU (docs/performance.md)
#   scripts/gpu_check.sh --dry-run --parts env,flagship   # the same code paths on CPU (the test suite runs it)
#
# Results in $OUT (default ./gpu_check). Needs torch (a CUDA build, but for --dry-run) and Lightning;
# what the launcher needs beyond them (Hydra, OmegaConf) comes from the wheels in $GPU_WHEELS
# (default .whl, made by scripts/gpu_wheels.sh), installed with --no-index into a folder put on
# PYTHONPATH, with this checkout's package (copied from here, so the check runs the code it was sent with).
# Exit status 1 when a part failed, 2 when no GPU is visible (without --dry-run); a part still running
# 30 s past its budget fails and stops the check (its JSON and gpu_check.log keep what was found).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${VIRTUAL_ENV:-}" ] && [ -f .venv/bin/activate ]; then
  . .venv/bin/activate
fi
py="$(command -v python3 || command -v python)"
out="${OUT:-gpu_check}"
mkdir -p "$out"
# torch.cuda.is_available() asks NVML instead of initialising CUDA: the workers are forked
export PYTORCH_NVML_BASED_CUDA_CHECK=1 PYTHONUNBUFFERED=1
wheels="${GPU_WHEELS:-.whl}"
site="${GPU_SITE:-${TMPDIR:-/tmp}/launcher-gpu-site}"
if ! "$py" -c "import hydra, omegaconf, launcher.conf" 2>/dev/null; then
  t0=$SECONDS
  if ! ls "$wheels"/*.whl >/dev/null 2>&1; then
    echo "gpu_check: Hydra or OmegaConf is missing here and $wheels holds no wheels: run scripts/gpu_wheels.sh" \
      "where pip reaches PyPI, and carry $wheels" >&2
    exit 2
  fi
  # the wheels: nothing from a registry (--no-index), nothing beside what is named (--no-deps)
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$wheels"/*.whl
  # then this checkout as installing it lays it out (pyproject.toml's package-dir: conf/ is launcher.conf,
  # which a bare checkout on PYTHONPATH lacks), copied rather than built: no build tools needed there
  rm -rf "$site/launcher"
  cp -r launcher "$site/launcher"
  cp -r conf "$site/launcher/conf"
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  # the env part's JSON says it too
  export GPU_CHECK_INSTALLED="$(ls "$wheels" | tr '\n' ' ')and this checkout into $site ($((SECONDS - t0)) s)"
  echo "gpu_check: installed $GPU_CHECK_INSTALLED" | tee -a "$out/gpu_check.log" >&2
else
  # the package from this checkout even where it is not installed
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
exec "$py" benchmarks/gpu_check.py --out "$out" "$@"
