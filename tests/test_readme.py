"""Every runnable snippet of README.md runs as written, on the bundled model, from the repository root.

Snippets are fenced ```python or ```bash blocks (a block without a language is a synopsis, not a command). Two
commands of the Quickstart are CI's own steps, so .ci/run runs them itself: the setup script and the test command
(running the suite from inside the suite would recurse); this module checks that .ci/run does run them, and runs
every other command of every snippet.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
CI_STEPS = ("bash scripts/setup.sh", ".venv/bin/python -m pytest")


def snippets() -> list[tuple[str, str]]:
    return FENCE.findall(README.read_text(encoding="utf-8"))


def bash_commands() -> list[str]:
    """Each command of the bash snippets: a line without its comment, split at ``&&`` (each part must succeed)."""
    commands = []
    for language, code in snippets():
        if language == "bash":
            for line in code.splitlines():
                line = line.split(" # ")[0].strip()
                if line and not line.startswith("#"):
                    commands += [part.strip() for part in line.split(" && ")]
    return commands


def run(command: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env, timeout=timeout)


def test_the_snippets_are_python_bash_or_synopses():
    languages = {language for language, _ in snippets()}
    assert languages <= {"python", "bash", ""}, languages
    assert {"python", "bash"} <= languages


def test_ci_runs_the_setup_and_test_commands_itself():
    ci = (ROOT / ".ci" / "run").read_text()
    steps = [c for c in bash_commands() if c.startswith(CI_STEPS)]
    assert {c.split()[0] + " " + c.split()[1] for c in steps} == {"bash scripts/setup.sh", ".venv/bin/python -m"}
    for step in steps:
        assert re.search(rf"^\s*(\S+=\S+ )*{re.escape(step)}", ci, re.MULTILINE), f".ci/run does not run {step!r}"


@pytest.mark.parametrize("command", [c for c in bash_commands() if not c.startswith(CI_STEPS)])
def test_bash_snippet_command_runs(command):
    result = run(["bash", "-o", "pipefail", "-c", command])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip(), f"{command!r} printed nothing; stderr: {result.stderr}"
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("code", [code for language, code in snippets() if language == "python"])
def test_python_snippet_runs(code):
    result = run([sys.executable, "-c", code])
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    stats = next(i for i, line in enumerate(lines) if line.startswith("GenerationStats("))  # on a line of its own
    assert "".join(lines[:stats]).strip(), "the streamed completion is missing"
    assert any(line.strip() for line in lines[stats + 1 :]), "the reply and the token ids are missing"
