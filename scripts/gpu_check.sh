#!/usr/bin/env bash
# The GPU check: every scheme's oracle on CUDA (float32 and bf16-mixed), NCCL at world size 1, the
# engine's own cost on a 1 B Llama (step time, tokens/s, MFU), predicted beside measured time and
# memory, and the transformer benchmark under NCCL. At most 8 minutes on one H100 or H200.
#
#   scripts/gpu_check.sh                 # results in $OUT (default ./gpu_check): gpu_check.json, gpu_check.txt
#   scripts/gpu_check.sh --dry-run       # the same code paths on CPU in seconds (the test suite runs it)
#
# Needs a CUDA build of torch in the active environment (or in .venv). Exit status 1 when a part failed;
# a part still running 30 s past its budget fails and stops the check (gpu_check.json and
# gpu_check.log keep what was found up to then).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${VIRTUAL_ENV:-}" ] && [ -f .venv/bin/activate ]; then
  . .venv/bin/activate
fi
# torch.cuda.is_available() asks NVML instead of initialising CUDA: the workers are forked
export PYTORCH_NVML_BASED_CUDA_CHECK=1
# the package from this checkout even where it is not installed (a bare machine with a CUDA torch);
# progress lines as they happen, also when the output goes through a pipe
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "$(command -v python3 || command -v python)" benchmarks/gpu_check.py --out "${OUT:-gpu_check}" "$@"
