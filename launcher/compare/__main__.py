"""``python -m launcher.compare <sweep or run dirs...> [-o comparison.html]``: the runs side by side
in one self-contained HTML page (see :mod:`launcher.compare.page`)."""

from __future__ import annotations

import argparse
import sys

from .page import build


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m launcher.compare", description=__doc__.split("\n\n")[0])
    p.add_argument("paths", nargs="+", help="run directories or sweep directories (searched recursively)")
    p.add_argument("-o", "--out", default="comparison.html", help="the HTML file to write (default: %(default)s)")
    p.add_argument("--title", default="launcher: runs side by side")
    args = p.parse_args(argv)
    try:
        out = build(args.paths, args.out, args.title)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}.".replace("..", "."), file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
