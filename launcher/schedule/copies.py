"""``fault.copies=1`` in the model: which stages each worker copies to another after every step,
and which copies it keeps (the runtime side: :mod:`launcher.lightning.copies`).

A stage held by one worker alone (a *lone* stage: every stage under fsdp and gpipe, fslpp's
weights, lpp's with ``G=1``) is sent after each optimizer step to the next worker in a ring
(``w + 1 mod W``), which keeps it in place of the previous copy. A stage with several owners has a
replica already and is not copied. Pure Python, so the simulator and the planner count it::

    sent(w) = the lone stages w owns                 # per step: its parameters and optimizer state out
    kept(w) = sent(w - 1 mod W)                      # held all the time: the copy it keeps
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence


def ring_copies(owned: Sequence[set[int]]) -> tuple[list[set[int]], list[set[int]]]:
    """Per worker, the stages it sends after each step and those whose copy it keeps, from the
    stages each worker owns (``owned[w]``). One worker has no one to copy to: nothing moves."""
    W = len(owned)
    if W < 2:
        return [set() for _ in owned], [set() for _ in owned]
    owners = Counter(s for own in owned for s in own)
    sent = [{s for s in own if owners[s] == 1} for own in owned]
    return sent, [set(sent[(w - 1) % W]) for w in range(W)]
