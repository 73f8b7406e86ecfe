"""``python -m launcher``: see :mod:`launcher.cli`."""

from .cli import main

main()
