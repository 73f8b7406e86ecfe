"""The Zero Bubble paper's Table 5 (Qi et al., ICLR 2024), from its profiled times, beside ours.

    python benchmarks/zero_bubble_table.py                 # all twelve rows (the p=32 ones take minutes)
    python benchmarks/zero_bubble_table.py --max-p 16

Per row: the bubble rate ``(cost - m (T_F + T_B + T_W)) / cost`` of the paper's ZB-1p and ZB-2p
(its automatic schedule at limits ``p`` and ``2p`` micro-batches of activations) and of our
``order=auto`` at the same limits, two ways:

- under the paper's rules: the cost is the longest worker's span (``auto_order.span``, the
  paper's formula 3, what a step costs once the optimizer-step synchronisation is bypassed: the
  steady state of ``step_overlap=post_validation``) and an ``I`` gives back all but ``M_W / M_B``
  of its micro-batch's activations (the paper's Table 1; ``graph_share`` in the one memory model);
- under this runtime's: the cost is the makespan (a step ends on every worker before the next
  begins) and a micro-batch's whole unit lives from its ``F`` to its ``W``; the column "bound" is
  the least makespan any schedule has, ``(p-1)(T_F + comm) + m (T_F + T_B + T_W)``.

The rows (the paper's Table 9 timings) are the test data of ``tests/schedule/test_zb_h1.py``,
read from there so that the table and the tests cannot drift apart.
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from dataclasses import replace
from pathlib import Path

from rich.console import Console
from rich.table import Table

from launcher.schedule import unchecked_schedule
from launcher.schedule.activations import unit_peaks
from launcher.schedule.auto_order import auto_sequences, run_sequences, span

#: the Zero Bubble paper's Table 4 and the helpers the tests check it with (tests/schedule/test_zb_h1.py),
#: read from that file rather than copied here
_spec = importlib.util.spec_from_file_location("test_zb_h1", Path(__file__).resolve().parents[1] / "tests" /
                                               "schedule" / "test_zb_h1.py")
assert _spec is not None and _spec.loader is not None
_paper = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_paper)
ROWS, ZB_1P, ZB_2P, w_share = _paper.ROWS, _paper.ZB_1P, _paper.ZB_2P, _paper.w_share


def rate(cost: float, work: float) -> float:
    return (cost - work) / cost


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-p", type=int, default=32, help="only the rows with at most this many stages")
    args = ap.parse_args()
    table = Table("model", "p", "m", "ZB-1p (paper)", "auto p, paper's rules", "ZB-2p (paper)",
                  "auto 2p, paper's rules", "auto 2p, makespan", "bound", "seconds")
    for row, zb1, zb2 in zip(ROWS, ZB_1P, ZB_2P):
        model, p, m, tf, tb, tw, comm, _, _ = row
        if p > args.max_p:
            continue
        t0 = time.perf_counter()
        work = m * (tf + tb + tw)
        base = unchecked_schedule("gpipe", p, m, 1, p, order="zb_h1", split_backward=True,
                              durations={"F": tf, "I": tb, "W": tw}, comm=comm)
        cells = []
        for limit in (p, 2 * p):
            step = replace(base, memory_limit=limit, graph_share=w_share(model))
            tl = run_sequences(step, auto_sequences(step, objective="span"))
            assert max(unit_peaks(tl)) <= limit + 1e-9
            cells.append(f"{rate(span(tl), work):.5f}")
        ours = run_sequences(base, auto_sequences(replace(base, memory_limit=2 * p)))
        bound = (p - 1) * (tf + comm) + work
        table.add_row(model, str(p), str(m), f"{zb1:.4f}", cells[0], f"{zb2:.4f}", cells[1],
                      f"{rate(ours.latency, work):.4f}", f"{rate(bound, work):.4f}", f"{time.perf_counter() - t0:.0f}")
        Console().print(f"{model} p={p} m={m} done", style="dim")
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
