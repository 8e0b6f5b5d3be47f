"""User settings, caches and the recent-model list, in platformdirs' per-user directories.

PERFX_CONFIG_DIR and PERFX_CACHE_DIR override the locations (tests use them to stay out of $HOME).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import platformdirs

APP = "perfx"
MAX_RECENT_MODELS = 10


def config_dir() -> Path:
    return Path(os.environ.get("PERFX_CONFIG_DIR") or platformdirs.user_config_dir(APP))


def cache_dir() -> Path:
    return Path(os.environ.get("PERFX_CACHE_DIR") or platformdirs.user_cache_dir(APP))


def settings_path() -> Path:
    return config_dir() / "settings.json"


def load_settings() -> dict[str, Any]:
    """The saved settings, or {} when there are none or the file is unreadable (it is then rewritten)."""
    try:
        data = json.loads(settings_path().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def save_settings(settings: dict[str, Any]) -> None:
    """Write atomically (temporary file + rename), so a crash never leaves half a settings file."""
    path = settings_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".settings-", suffix=".json")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(settings, f, indent=2)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def recent_models() -> list[str]:
    return [m for m in load_settings().get("recent_models", []) if isinstance(m, str)]


def remember_model(path: str | os.PathLike[str]) -> None:
    """Put ``path`` first in the recent-model list."""
    path = str(Path(path).resolve())
    settings = load_settings()
    models = [path] + [m for m in recent_models() if m != path]
    settings["recent_models"] = models[:MAX_RECENT_MODELS]
    save_settings(settings)
