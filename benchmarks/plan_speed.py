"""How long ``mode=plan``'s search takes for 16 workers, 16 stages and 32 micro-batches (a
benchmark, not a test). Target on the project's 2-core machine: under 10 s for every budget.

    python benchmarks/plan_speed.py

Prints, per budget: seconds, steps simulated, steps pruned by the time and memory bounds, and the
best candidate. The profile is synthetic (10 ms forward, 20 ms backward split 11 + 9, 1 ms per
message; 50 MB parameters and gradients, 100 MB optimizer state, 20 MB activations per stage; a
link of 20 us and 10 GB/s, so the gradient exchange after the compute is priced per scheme).
"""

from __future__ import annotations

import time

from launcher.plan import Budget, search, unit
from launcher.plan.profile import from_dict

S, B, WORKERS = 16, 32, 16
PROFILE = from_dict({
    "durations_s": {"F": 0.010, "B": 0.020, "I": 0.011, "W": 0.009}, "comm_s": 0.001,
    "bytes": {"params": [50e6] * S, "grads": [50e6] * S, "optimizer": [100e6] * S, "activation": [20e6] * S},
    "link": {"latency_s": 20e-6, "bytes_per_s": 10e9},
})
UNIT = unit({"F": 1.0, "B": 1.0, "I": 0.5, "W": 0.5}, 0.0)
BUDGETS = [
    ("unit costs, no budget", UNIT, Budget()),
    ("unit costs, 8 activations", UNIT, Budget(activations=8)),
    ("unit costs, 4 activations", UNIT, Budget(activations=4)),
    ("profile, no budget", PROFILE, Budget()),
    ("profile, 2 GB", PROFILE, Budget(bytes=2e9)),
    ("profile, 1 GB", PROFILE, Budget(bytes=1e9)),
    ("profile, 600 MB", PROFILE, Budget(bytes=6e8)),
    ("profile, 1.5 GB and 6 activations", PROFILE, Budget(activations=6, bytes=1.5e9)),
]


def main() -> None:
    worst = 0.0
    for name, prof, budget in BUDGETS:
        t = time.perf_counter()
        plan = search(S, [B], WORKERS, prof, budget)
        dt = time.perf_counter() - t
        worst = max(worst, dt)
        b = plan.best
        best = "nothing fits" if b is None else (
            f"{b.point.scheme.label} G={b.point.G} R={b.point.R} {b.point.order}/{b.point.warmup} "
            f"split={b.point.split} limit={b.point.memory_limit} cache={b.point.weight_cache} step={b.step_time:.4g}")
        print(f"{name:36s} {dt:6.2f} s  simulated {plan.simulated:5d}  pruned {plan.pruned_time:4d} (time) "
              f"{plan.pruned_memory:3d} (memory)  best: {best}")
    print(f"worst {worst:.2f} s (target < 10 s) for {WORKERS} workers, {S} stages, {B} micro-batches")


if __name__ == "__main__":
    main()
