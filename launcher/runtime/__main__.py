"""``python -m launcher.runtime``: an alias of ``python -m launcher`` (one set of keys, one
validation path). Training on real workers is the launcher's default mode::

    python -m launcher.runtime strategy=fslpp G=2 R=2 stages=4 microbatches=4
    torchrun --standalone --nproc-per-node 4 -m launcher strategy=lpp G=2 R=2 stages=4 microbatches=4

The engine itself stays usable from Python (``launcher.runtime.Engine`` on every rank of a process
group, ``launcher.runtime.launch`` to fork them): see the README.
"""

from __future__ import annotations

import sys


def main() -> None:
    if any(a.startswith("--") and a not in ("--help", "--hydra-help", "--info", "--cfg", "--multirun",
                                              "--config-dir", "--config-name", "--config-path", "--resolve",
                                              "--package", "--shell-completion", "--experimental-rerun")
           for a in sys.argv[1:]):
        flag = next(a for a in sys.argv[1:] if a.startswith("--"))
        print(f"error: {flag.split('=')[0]} is not an option: python -m launcher.runtime is an alias of "
              f"python -m launcher and takes its keys as overrides, e.g. strategy=fslpp G=2 R=2 stages=4 "
              f"microbatches=4 (see python -m launcher --help).", file=sys.stderr)
        sys.exit(2)
    from launcher.cli import main as launcher_main

    launcher_main()


if __name__ == "__main__":
    main()
