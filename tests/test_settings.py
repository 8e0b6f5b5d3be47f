"""Settings and the recent-model list live in platformdirs' user directories, written atomically."""

from __future__ import annotations

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
    assert [p.name for p in settings.config_dir().iterdir()] == ["settings.json"]  # no temp files left
