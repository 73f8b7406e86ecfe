"""Shared by every test module."""

# launcher first: where torchvision's extension cannot load (a CPU torch beside PyPI's CUDA
# torchvision), importing lightning fails unless launcher's torchvision fallback is installed
import launcher  # noqa: F401
