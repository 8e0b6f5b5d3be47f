"""Summarize a step trace (scripts/step_trace/sitecustomize.py): per step kind and running rows (in fours),
the mean / p99 in ms of each part of a step, and with profiling the mean device ms per step of each kernel.

    python scripts/step_trace/summarize_steps.py steps.jsonl
"""

import json
import statistics
import sys

FIELDS = ("total", "replay", "read", "accept", "gap", "gpu_span", "gpu_busy")


def main() -> None:
    groups: dict[tuple[str, int], list[dict]] = {}
    with open(sys.argv[1]) as lines:
        for line in lines:
            row = json.loads(line)
            if row["gap"] is not None:  # the first step after start-up waited for the first request
                groups.setdefault((row["kind"] or "plain", min(row["running"], 16) // 4 * 4), []).append(row)
    for (kind, running), rows in sorted(groups.items()):
        if len(rows) < 20:
            continue
        parts = [f"{kind:>5} running {running:>2}+: {len(rows):>5} steps"]
        for field in FIELDS:
            values = sorted(row[field] for row in rows if row.get(field) is not None)
            if values:
                p99 = values[int(0.99 * (len(values) - 1))]
                parts.append(f"{field} {1e3 * statistics.mean(values):.2f}/{1e3 * p99:.2f}")
        profiled = [row for row in rows if "launches" in row]  # steps that replayed a graph, with profiling on
        if profiled:
            parts.append(f"launches {statistics.mean(row['launches'] for row in profiled):.0f}")
        print("  ".join(parts))
        kernels: dict[str, float] = {}
        for row in profiled:
            for name, seconds in row.get("gpu_by_kernel", {}).items():
                kernels[name] = kernels.get(name, 0.0) + seconds / len(profiled)
        if kernels:  # mean device ms per step, largest first
            print(
                "      "
                + ", ".join(f"{name} {1e3 * t:.2f}" for name, t in sorted(kernels.items(), key=lambda kv: -kv[1]))
            )


if __name__ == "__main__":
    main()
