"""``perfx bench``'s report as a Markdown table, one row per test as llama-bench prints it: ``ppN`` is prefill of N
prompt tokens, ``tgN`` generating N tokens, in tokens per second (median ± standard deviation over the runs)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any


def format_report(report: dict[str, Any]) -> str:
    model, size, params = _model_columns(Path(report["model"]))
    rows = [
        (f"pp{report['prompt_tokens']}", _speed(report["runs"], "prefill_tokens_per_s")),
        (f"tg{report['gen_tokens']}", _speed(report["runs"], "decode_tokens_per_s")),
    ]
    header = ("model", "size", "params", "backend", "test", "t/s")
    right = {"size", "params", "t/s"}
    table = [header, *[(model, size, params, report["backend"], test, speed) for test, speed in rows]]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]

    def line(cells) -> str:
        return (
            "| "
            + " | ".join(
                c.rjust(w) if h in right else c.ljust(w) for c, w, h in zip(cells, widths, header, strict=True)
            )
            + " |"
        )

    rule = (
        "| "
        + " | ".join("-" * (w - 1) + (":" if h in right else "-") for w, h in zip(widths, header, strict=True))
        + " |"
    )
    out = [line(header), rule, *(line(r) for r in table[1:])]
    out.append("")
    out.append(
        f"on {report['device']}: time to first token {report['time_to_first_token_s'] * 1e3:.0f} ms; "
        f"load {report['load_s']:.1f} s, "
        f"warm-up {report['warmup_s']:.1f} s; peak memory {_mib(report['peak_host_bytes'])} on the host, "
        f"{_mib(report['backend_bytes'])} held by the backend; KV cache {report['kv_dtype']}; "
        f"{report['repeat']} run(s)"
    )
    if report.get("weight_bytes"):
        kinds = ", ".join(f"{kind} {w['bytes_per_weight']:.2f}" for kind, w in report["weight_bytes"].items())
        out.append(f"bytes per weight held by the backend (copies and layouts included): {kinds}")
    profile = report["runs"][0].get("decode_op_profile_ms_per_token") if report["runs"] else None
    if profile:
        out.append("")
        out.append("decode, ms per token by op (first run):")
        for op, ms in sorted(profile.items(), key=lambda item: -item[1]):
            out.append(f"  {op:22s} {ms:8.3f}")
    return "\n".join(out)


def _speed(runs: list[dict[str, Any]], key: str) -> str:
    values = [r[key] for r in runs if r.get(key) is not None]
    if not values:
        return "n/a"
    median = statistics.median(values)
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{median:.2f} ± {spread:.2f}"


def _model_columns(path: Path) -> tuple[str, str, str]:
    """(architecture and quantization, size, parameters) from the model's header."""
    from .model_catalog import Found, describe

    info = describe(Found(path.name.removesuffix(".gguf"), path, "bench"))
    label = f"{info.architecture} {info.quantization}" if info.architecture != "?" else path.name
    params = f"{info.parameters / 1e6:.1f} M" if info.parameters else "?"
    return label, _mib(info.size_bytes), params


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"
