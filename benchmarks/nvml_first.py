"""Imported before torch by a benchmark that forks CUDA workers: ``torch.cuda.is_available()`` then
asks NVML rather than initialising CUDA, since a child of a process that initialised CUDA cannot
use it. An import, not a statement above the imports, so the importing module's imports stay
plain imports (no ``noqa: E402``)."""

import os

os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
