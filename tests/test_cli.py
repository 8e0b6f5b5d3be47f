"""The perfx command line, run as a user runs it: a real process on the real default model. What needs no process
(parsing, help, errors raised before a model loads) calls the CLI's main() in this process."""

from __future__ import annotations

import argparse
import inspect
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from perfx_core import __version__, defaults
from perfx_core.cli import build_parser, main, why_nothing_came_out
from perfx_core.cli_options import CONTEXT_ALIASES


def perfx(*args: str, input: str | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("perfx")
    command = [str(exe)] if exe.exists() else [sys.executable, "-m", "perfx_core"]
    return subprocess.run(
        [*command, *args], capture_output=True, text=True, input=input, timeout=timeout, env=os.environ.copy()
    )


def test_perfx_script_is_installed():
    assert Path(sys.executable).with_name("perfx").exists() or shutil.which("perfx")


def test_run_answers_a_prompt_from_stdin_with_the_chat_template_and_shows_progress():
    result = perfx("run", "-", "--temperature", "0", "--max-tokens", "16", input="What is the capital of France?\n")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "perfx: loading SmolLM2-135M-Instruct.Q4_1.gguf on numpy / CPU" in result.stderr
    assert "perfx: loaded SmolLM2-135M-Instruct.Q4_1.gguf in " in result.stderr
    assert "tok/s" in result.stderr and "finish: stop" in result.stderr
    settings = json.loads((Path(os.environ["PERFX_CONFIG_DIR"]) / "settings.json").read_text())
    assert settings["recent_models"][0].endswith("SmolLM2-135M-Instruct.Q4_1.gguf")


def test_run_raw_completes_the_text_and_quiet_hides_stderr(capsys):
    assert main(["run", "The capital of France is", "--raw", "-t", "0", "-n", "4", "--quiet"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith(" Paris") and err == ""


def test_run_says_why_no_text_came_out(capsys):
    # Greedy, the answer starts "The capital of France is Paris.": the stop string ends it before any text.
    assert main(["run", "What is the capital of France?", "-t", "0", "--stop", "The"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == ""
    assert "perfx: no text came out: a --stop string matched before any text" in err


def test_an_immediate_end_of_sequence_is_explained(smollm2):
    eos = smollm2.tokenizer.eos_id
    generation = smollm2.generate("Hello", max_tokens=4, logit_bias={eos: 100})
    assert generation.run() == "" and generation.stats.generated_tokens == 0
    why = why_nothing_came_out(generation, chat=False, has_template=True)
    assert why.startswith("no text came out: the model ended its reply at once")
    assert "drop --raw" in why
    assert "no chat template" in why_nothing_came_out(generation, chat=False, has_template=False)


def test_backends_lists_numpy_with_device_and_ops():
    result = perfx("backends", "--ops")
    assert result.returncode == 0, result.stderr
    assert "numpy" in result.stdout and "device 0: CPU" in result.stdout
    assert "attention_decode" in result.stdout


def test_check_backend_numpy_passes():
    result = perfx("check-backend", "numpy", "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["passed"] is True


@pytest.mark.parametrize("prompt_tokens, gen_tokens", [(16, 1), (1, 2), (16, 2)])
def test_bench_fits_its_warm_up_in_the_context_it_asks_for(prompt_tokens, gen_tokens):
    from perfx_core.bench import run_bench

    report = run_bench(None, prompt_tokens=prompt_tokens, gen_tokens=gen_tokens, repeat=1)
    assert report["prefill_tokens_per_s"] > 0
    assert (report["decode_tokens_per_s"] is None) == (gen_tokens == 1)


def test_bench_prints_json_and_a_table_like_llama_bench(smollm2_path):
    from perfx_core.bench_table import format_report
    from perfx_core.gguf_file import read_gguf

    result = perfx("bench", "-p", "16", "-g", "4", "-r", "2", "--profile", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    for key in (
        "prefill_tokens_per_s",
        "decode_tokens_per_s",
        "time_to_first_token_s",
        "peak_host_bytes",
        "backend_bytes",
    ):
        assert report[key] > 0, key
    assert "attention_decode" in report["runs"][0]["decode_op_profile_ms_per_token"]
    assert "perfx: warming up" in result.stderr and "perfx: run 2/2: prefill" in result.stderr

    table = format_report(report)  # what `perfx bench` prints without --json
    lines = table.splitlines()
    assert [c.strip() for c in lines[0].split("|")[1:-1]] == ["model", "size", "params", "backend", "test", "t/s"]
    assert [c.strip()[-1] for c in lines[1].split("|")[1:-1]] == ["-", ":", ":", "-", "-", ":"]  # right-aligned
    rows = {line.split("|")[5].strip(): line.split("|") for line in lines[2:4]}
    assert set(rows) == {"pp16", "tg4"}
    size = f"{smollm2_path.stat().st_size / 2**20:.1f} MiB"
    params = f"{sum(t.n_elements for t in read_gguf(smollm2_path).tensors.values()) / 1e6:.1f} M"
    speeds = {"pp16": "prefill_tokens_per_s", "tg4": "decode_tokens_per_s"}
    for test, cells in rows.items():
        assert [c.strip() for c in cells[1:5]] == ["llama Q4_1", size, params, "numpy"]
        median, spread = (float(x) for x in cells[6].split("±"))
        values = [run[speeds[test]] for run in report["runs"]]
        assert median == pytest.approx(statistics.median(values), abs=0.01)
        assert spread == pytest.approx(statistics.stdev(values), abs=0.01)
    assert f"on {report['device']}: time to first token" in table
    assert "attention_decode" in table
    # Bytes per weight the backend holds, per kind of matrix: SmolLM2's Q4_1 matrices in its file's bytes (0.5 byte
    # of codes + a float16 scale and bias per 32: 0.625) where perfx-numba-cpu holds them as its blocks, else at
    # least the host format's (a float32 bias: 0.6875); its Q8_0 embedding (the tied LM head too) exactly the file's
    # int8 codes and float16 scales, 34 bytes per 32 weights.
    held = report["weight_bytes"]
    assert set(held) == {"qkv", "wo", "gate_up", "down", "embedding"}  # tied: no separate output
    q = 576
    assert held["qkv"]["weights"] == 30 * (q + 2 * 192) * q and held["embedding"]["weights"] == 49152 * q
    numba = report["ops"]["linear"].startswith("numba-cpu:")
    for kind in ("qkv", "wo", "gate_up", "down"):
        if numba:
            assert held[kind]["bytes"] == held[kind]["weights"] * 20 // 32, held[kind]
        else:
            assert held[kind]["bytes_per_weight"] >= 0.6875, held[kind]
    assert held["embedding"]["bytes"] == 49152 * q * 34 // 32
    assert held["embedding"]["bytes_per_weight"] == pytest.approx(1.0625, abs=1e-3)
    assert "bytes per weight held by the backend" in table


@pytest.mark.parametrize(
    "args, message",
    [
        (("run", "x", "--model", "/nonexistent/model.gguf"), "does not exist"),
        (("run", "x", "--model", "no-such-model-name"), "nor a name `perfx models` lists"),
        (("run", "x", "--backend", "nope"), "no backend named 'nope'"),
        (("run", "x", "--device", "7"), "one device"),
    ],
)
def test_user_errors_are_one_clear_line(args, message):
    result = perfx(*args)
    assert result.returncode == 2
    assert result.stderr.startswith("perfx: error:") and message in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (("run", "x", "--max-tokens", "-5"), "argument --max-tokens/-n: must be an integer >= 1; got -5"),
        (("run", "x", "--temperature", "-1"), "argument --temperature/-t: must be >= 0 (0 is greedy); got -1.0"),
        (("run", "x", "--top-p", "1.5"), "argument --top-p: must be in (0, 1]"),
        (("run", "x", "--top-k", "-1"), "argument --top-k: must be an integer in [0, 2147483647]"),
        (("run", "x", "--min-p", "1"), "argument --min-p: must be in [0, 1)"),
        (("run", "x", "--seed", "1.5"), "argument --seed: expected an integer; got '1.5'"),
        (("run", "x", "--context", "0"), "argument --context/-c: must be an integer >= 1; got 0"),
        (("run", "x", "--context", "64", "--max-tokens", "64"), "--max-tokens 64 leaves no room for the prompt"),
        (("run", "", "--raw"), "the prompt is empty"),
        (("run", "x", "--raw", "--system", "Be brief."), "--system needs the model's chat template"),
        (("chat", "--repetition-penalty", "0"), "argument --repetition-penalty: must be > 0"),
        (("bench", "--prompt-tokens", "0"), "argument --prompt-tokens/-p: must be an integer >= 1; got 0"),
        (("serve", "--max-running", "0"), "argument --max-running: must be an integer >= 1; got 0"),
    ],
)
def test_bad_arguments_fail_before_the_model_loads_naming_the_flag(args, message, capsys):
    assert _exit_code(main, list(args)) == 2
    err = capsys.readouterr().err
    assert err.startswith("perfx: error:") and message in err, err
    assert "loading" not in err  # no model was loaded


def _exit_code(function, *args) -> int:
    try:
        return function(*args)
    except SystemExit as exc:  # argparse's errors
        return exc.code


def test_run_dash_with_empty_stdin_is_an_error():
    result = perfx("run", "-", input="")
    assert result.returncode == 2 and "the prompt is empty (stdin gave no text)" in result.stderr


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"perfx {__version__}"


@pytest.mark.parametrize("command", [["run", "x"], ["chat"], ["bench"], ["serve"], ["gui"], ["eval", "ppl", "m.gguf"]])
def test_the_context_option_has_one_name_and_hidden_aliases(command):
    parser = build_parser()
    extra = ["--text", "t.txt"] if command[0] == "eval" else []
    assert parser.parse_args([*command, *extra, "--context", "64"]).context == 64
    assert parser.parse_args([*command, *extra, "-c", "96"]).context == 96
    for alias in CONTEXT_ALIASES:
        assert parser.parse_args([*command, *extra, alias, "32"]).context == 32
    help_text = _subparser(parser, command).format_help()
    assert "--context" in help_text and not any(alias in help_text for alias in CONTEXT_ALIASES)


def test_every_option_of_every_command_has_help():
    missing = []

    def walk(parser: argparse.ArgumentParser, name: str) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub_name, sub in action.choices.items():
                    walk(sub, f"{name} {sub_name}")
            elif action.help != argparse.SUPPRESS and not (action.help or "").strip():
                missing.append(f"{name} {'/'.join(action.option_strings) or action.dest}")

    walk(build_parser(), "perfx")
    assert not missing, missing


def test_the_defaults_are_the_shared_ones():
    args = build_parser().parse_args(["run", "x"])
    assert args.max_tokens is None  # defaults.MAX_TOKENS, lowered to what the context has left
    assert (args.temperature, args.top_k, args.top_p, args.min_p) == (
        defaults.TEMPERATURE,
        defaults.TOP_K,
        defaults.TOP_P,
        defaults.MIN_P,
    )
    assert defaults.MAX_TOKENS >= 512
    # The Python API's defaults are the same ones.
    from perfx_core.api import Model
    from perfx_core.sampling import SamplingParams

    api = inspect.signature(Model.generate).parameters
    assert api["max_tokens"].default == defaults.MAX_TOKENS
    params = SamplingParams()
    for name in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty"):
        assert getattr(params, name) == api[name].default == getattr(defaults, name.upper())


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04 not a model")
    result = perfx("run", "x", "--model", str(bad))
    assert result.returncode == 2 and "not a GGUF file" in result.stderr


def _subparser(parser: argparse.ArgumentParser, command: list[str]) -> argparse.ArgumentParser:
    for word in command:
        action = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        if action is None or word not in action.choices:
            break
        parser = action.choices[word]
    return parser
