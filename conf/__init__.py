"""Hydra config groups (shipped as the package ``launcher.conf``)."""
