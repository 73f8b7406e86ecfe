"""Where ``"auto"`` cuts a traced forward: the choice among module boundaries, apart from the graph
it is made on (:mod:`launcher.split.cut` measures the graph and builds the stages)."""

from __future__ import annotations

from typing import Sequence


def least_largest_stage(W: Sequence[int], cands: Sequence[int], live: Sequence[int], depth: dict[int, int],
                        k: int) -> list[int]:
    """``k`` of the positions ``cands`` (sorted): least largest stage, then least sum of squared
    stage sizes, then fewest bytes crossing the cuts (``live[c]``), then outermost modules
    (``depth[c]``). ``W[i]`` is the size of everything before position ``i`` (prefix sums;
    ``W[-1]`` the whole). Needs ``1 <= k <= len(cands)``."""
    m, N = len(cands), len(W) - 1

    def fits(T: int) -> bool:  # can k cuts keep every stage at most T? (another cut never enlarges one)
        cur, used, j = 0, 0, 0
        while W[N] - W[cur] > T:
            while j < m and cands[j] <= cur:
                j += 1
            best = None
            while j < m and W[cands[j]] - W[cur] <= T:
                best, j = cands[j], j + 1
            if best is None or used == k:
                return False
            cur, used = best, used + 1
        return True

    lo, hi = 0, W[N]
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid + 1, hi)
    T = lo
    # Among the cuts that keep every stage within T: least sum of squares, fewest bytes, outermost.
    cost: list[tuple[int, int, int] | None] = [((W[c] ** 2, live[c], depth[c]) if W[c] <= T else None)
                                               for c in cands]
    back: list[list[int]] = []
    for _ in range(k - 1):
        nxt: list[tuple[int, int, int] | None] = [None] * m
        arg = [-1] * m
        for i in range(m):
            for i2 in range(i - 1, -1, -1):
                seg = W[cands[i]] - W[cands[i2]]
                if seg > T:
                    break
                prev, here = cost[i2], nxt[i]
                if prev is None:
                    continue
                c = (prev[0] + seg * seg, prev[1] + live[cands[i]], prev[2] + depth[cands[i]])
                if here is None or c < here:
                    nxt[i], arg[i] = c, i2
        back.append(arg)
        cost = nxt
    best, last = None, -1
    for i in range(m):
        seg = W[N] - W[cands[i]]
        last_cost = cost[i]
        if last_cost is not None and seg <= T:
            c = (last_cost[0] + seg * seg, last_cost[1], last_cost[2])
            if best is None or c < best:
                best, last = c, i
    picked = [last]
    for arg in reversed(back):
        picked.append(arg[picked[-1]])
    return [cands[i] for i in reversed(picked)]
