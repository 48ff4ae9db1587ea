"""Simulator speed and policy comparison, side by side in one run (not a test).

    .venv/bin/python benchmarks/bench_simulate.py

Prints, per distribution and schedule, wall time of a 200,000-sample W=8 epoch and
the paper policy against all-ready: steps, idle steps, alignment overhead, waits,
with ratios.
"""

from __future__ import annotations

import time

from odb_core import ODBConfig, audit, simulate
from odb_core.distributions import sample_lengths


def main() -> None:
    print("| lengths | schedule | policy | seconds | steps/rank | idle steps | align. overhead | max wait "
          "| payload B/round | paper pkg payload B/round |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in ("ultrachat", "llava", "sharegpt4o"):
        lengths = sample_lengths(name, 200_000)
        for schedule in ("in_order", "random", "straggler"):
            rows = {}
            for policy in ("paper", "all-ready"):
                cfg = ODBConfig(token_budget=8192, buffer_size=1024, target_policy=policy)
                t0 = time.perf_counter()
                report = audit(simulate(lengths, 8, cfg, schedule))
                seconds = time.perf_counter() - t0
                rows[policy] = report
                print(
                    f"| {name} | {schedule} | {policy} | {seconds:.2f} | {report.steps_per_rank[0]} | "
                    f"{sum(report.idle_steps_per_rank)} | {report.alignment_overhead:.4f} | {report.max_wait_rounds} | "
                    f"{report.payload_bytes_per_round:.0f} | {(2 + 2 * 1024) * 8} |"
                )
            ratio = rows["all-ready"].steps_per_rank[0] / rows["paper"].steps_per_rank[0]
            print(f"| {name} | {schedule} | all-ready / paper steps | | {ratio:.3f} | | | | | |")


if __name__ == "__main__":
    main()
