"""Settings and the recent-model list live in platformdirs' user directories, written atomically."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from perfx_core import settings


def test_directories_follow_environment(tmp_path):
    assert settings.config_dir() == tmp_path / "config"
    assert settings.cache_dir() == tmp_path / "cache"


def test_default_directories_come_from_platformdirs(monkeypatch):
    import platformdirs

    monkeypatch.delenv("PERFX_CONFIG_DIR")
    assert str(settings.config_dir()) == platformdirs.user_config_dir("perfx")


def test_recent_models_most_recent_first_and_bounded(tmp_path):
    paths = []
    for i in range(settings.MAX_RECENT_MODELS + 3):
        p = tmp_path / f"m{i}.gguf"
        p.write_bytes(b"x")
        paths.append(p)
        settings.remember_model(p)
    settings.remember_model(paths[5])
    recent = settings.recent_models()
    assert recent[0] == str(paths[5].resolve())
    assert len(recent) == settings.MAX_RECENT_MODELS
    assert str(paths[-1].resolve()) == recent[1]


def test_corrupt_settings_file_is_replaced_not_fatal(tmp_path):
    settings.settings_path().parent.mkdir(parents=True)
    settings.settings_path().write_text("{not json")
    assert settings.load_settings() == {}
    settings.remember_model(tmp_path)
    assert settings.recent_models() == [str(tmp_path.resolve())]
    names = sorted(p.name for p in settings.config_dir().iterdir())
    assert names == ["settings.json", "settings.json.corrupt"]  # the bad file kept for the user, no temp files


def _write_settings(content: str | bytes) -> None:
    path = settings.settings_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content if isinstance(content, bytes) else content.encode())


@pytest.mark.parametrize(
    "content, field",
    [
        ('{"recent_models": null}', "recent_models"),
        ('{"recent_models": 5}', "recent_models"),
        ('{"recent_models": "/a/model.gguf"}', "recent_models"),
        ('{"recent_models": {"a": 1}}', "recent_models"),
        ('{"colour": "red"}', "colour"),
        ('{"recent_models": [[["/a/model.gguf"]]]}', "recent_models[0]"),
    ],
)
def test_wrong_typed_or_unknown_fields_are_dropped_with_a_warning(content, field, tmp_path, caplog):
    _write_settings(content)
    with caplog.at_level(logging.WARNING):
        assert settings.recent_models() == []
    assert str(settings.settings_path()) in caplog.text and field in caplog.text
    settings.remember_model(tmp_path)
    assert settings.recent_models() == [str(tmp_path.resolve())]
    assert json.loads(settings.settings_path().read_text()) == {"recent_models": [str(tmp_path.resolve())]}


def test_recent_model_entries_are_checked_one_by_one(caplog):
    good = ["/models/a.gguf", "/models/b"]
    entries = [good[0], 7, None, "", "x" * 10_000, "/bad\x00path", good[1], good[0]]
    entries += [f"/m{i}" for i in range(50)]
    _write_settings(json.dumps({"recent_models": entries}))
    with caplog.at_level(logging.WARNING):
        recent = settings.recent_models()
    assert recent[:2] == good and len(recent) == settings.MAX_RECENT_MODELS
    for i in (1, 2, 3, 4, 5):
        assert f"recent_models[{i}]" in caplog.text


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        "5",
        "null",
        '["a.gguf"]',
        "[" * 100_000,
        '{"a": ' * 100_000,
        b"\xff\xfe{}",
        '{"recent_models": ["/a"], "pad": "' + "x" * (2 << 20) + '"}',
    ],
    ids=["syntax", "number", "null", "array", "deep-array", "deep-object", "not-utf8", "huge"],
)
def test_corrupt_file_is_moved_aside_with_a_warning(content, caplog):
    _write_settings(content)
    original = settings.settings_path().read_bytes()
    with caplog.at_level(logging.WARNING):
        assert settings.load_settings() == {}
    aside = settings.settings_path().with_name("settings.json.corrupt")
    assert not settings.settings_path().exists() and aside.read_bytes() == original
    assert str(settings.settings_path()) in caplog.text and str(aside) in caplog.text
    assert settings.recent_models() == []


def test_perfx_run_survives_a_null_recent_list():
    _write_settings('{"recent_models": null}')
    exe = Path(sys.executable).with_name("perfx")
    command = [str(exe)] if exe.exists() else [sys.executable, "-m", "perfx_core"]
    result = subprocess.run(
        [*command, "run", "Hi", "-n", "1", "--quiet-stats"], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert "recent_models" in result.stderr and str(settings.settings_path()) in result.stderr
    recent = json.loads(settings.settings_path().read_text())["recent_models"]
    assert recent[0].endswith(".gguf")
