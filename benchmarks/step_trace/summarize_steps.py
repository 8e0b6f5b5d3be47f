"""Summarize a step trace (benchmarks/step_trace/sitecustomize.py): per step kind and running rows (in fours),
the mean / p99 in ms of each part of a step, and with profiling the mean device ms per step of each kernel;
then the gaps between consecutive steps' text sends (what a client sees as inter-token latency when every
running sequence gets a token per step) by the kinds of the two steps, next to the change in replay time,
and the largest of those gaps with what happened in them.

    python benchmarks/step_trace/summarize_steps.py steps.jsonl
"""

import itertools
import json
import statistics
import sys

FIELDS = ("total", "replay", "read", "take", "send", "gap", "gpu_span", "gpu_busy")


def _ms(values: list[float]) -> str:
    """mean/p99 in ms."""
    values = sorted(values)
    return f"{1e3 * statistics.mean(values):.2f}/{1e3 * values[int(0.99 * (len(values) - 1))]:.2f}"


def _send_pairs(steps: list[dict]) -> list[tuple[float, dict, dict]]:
    """(gap between their sends, earlier step, later step) of consecutive steps that both sent text, with 12+
    running in the later one."""
    return [
        (after["sent"] - before["sent"], before, after)
        for before, after in itertools.pairwise(steps)
        if before.get("sent") is not None and after.get("sent") is not None and after["running"] >= 12
    ]


def send_gaps(steps: list[dict]) -> None:
    """Gaps between the text sends of consecutive steps that both sent text, by (earlier kind -> later kind),
    with the later step's replay minus the earlier one's: with overlapped output a step's send follows its
    replay, so a longer replay delays that send by as much."""
    groups: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for gap, before, after in _send_pairs(steps):
        key = (before["kind"] or "plain", after["kind"] or "plain")
        groups.setdefault(key, []).append((gap, after["replay"] - before["replay"]))
    if groups:
        print("send gaps with 12+ running (ms, mean/p99), and the change in replay time:")
    for (first, second), pairs in sorted(groups.items()):
        if len(pairs) >= 5:
            gaps, deltas = [gap for gap, _ in pairs], [delta for _, delta in pairs]
            print(f"  {first:>5} -> {second:<5} {len(pairs):>5} gaps  {_ms(gaps)}  replay change {_ms(deltas)}")


def largest_gaps(steps: list[dict], count: int = 12) -> None:
    """The largest gaps between consecutive sends with 12+ running (the c16 p99 is about the 2nd-largest step
    gap of a level: every running sequence sees each step's gap), with what happened between the two sends: the
    earlier step's text handling, wait for the device and row taking, then the admissions, submissions and
    replay of the later step, and the garbage collector's time in both."""
    pairs = _send_pairs(steps)
    if not pairs:
        return
    gaps = sorted(gap for gap, _, _ in pairs)
    quantiles = ", ".join(f"p{q} {1e3 * gaps[int(q / 100 * (len(gaps) - 1))]:.2f}" for q in (50, 90, 99))
    print(f"send gaps with 12+ running: {len(gaps)}, ms: {quantiles}, max {1e3 * gaps[-1]:.2f}")
    print("  largest (ms): gap  kinds  | earlier step: send read take gc | later step: admitted submitted replay gc")
    for gap, before, after in sorted(pairs, key=lambda pair: -pair[0])[:count]:
        print(
            f"  {1e3 * gap:6.2f}  {before['kind']:>5} -> {after['kind']:<5} running {after['running']:>2}"
            f" | {1e3 * before['send']:5.2f} {1e3 * before['read']:5.2f} {1e3 * before['take']:5.2f}"
            f" {1e3 * before.get('gc', 0.0):5.2f} | {after.get('admitted', 0)} {after.get('submitted', 0)}"
            f" {1e3 * after['replay']:5.2f} {1e3 * after.get('gc', 0.0):5.2f}"
        )


def main() -> None:
    groups: dict[tuple[str, int], list[dict]] = {}
    steps: list[dict] = []
    with open(sys.argv[1]) as lines:
        for line in lines:
            row = json.loads(line)
            steps.append(row)
            if row["gap"] is not None:  # the first step after start-up waited for the first request
                groups.setdefault((row["kind"] or "plain", min(row["running"], 16) // 4 * 4), []).append(row)
    for (kind, running), rows in sorted(groups.items()):
        if len(rows) < 20:
            continue
        parts = [f"{kind:>5} running {running:>2}+: {len(rows):>5} steps"]
        for field in FIELDS:
            values = [row[field] for row in rows if row.get(field) is not None]
            if values:
                parts.append(f"{field} {_ms(values)}")
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

    send_gaps(steps)
    largest_gaps(steps)


if __name__ == "__main__":
    main()
