"""User settings, caches and the recent-model list, in platformdirs' per-user directories.

PERFX_CONFIG_DIR and PERFX_CACHE_DIR override the locations (tests use them to stay out of $HOME).
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import platformdirs

APP = "perfx"
MAX_RECENT_MODELS = 10
MAX_PATH_CHARS = 4096
MAX_SETTINGS_BYTES = 1 << 20  # far more than any real settings file; bounds the work of reading one
MAX_DEPTH = 16

log = logging.getLogger(__name__)


def config_dir() -> Path:
    return Path(os.environ.get("PERFX_CONFIG_DIR") or platformdirs.user_config_dir(APP))


def cache_dir() -> Path:
    return Path(os.environ.get("PERFX_CACHE_DIR") or platformdirs.user_cache_dir(APP))


def settings_path() -> Path:
    return config_dir() / "settings.json"


def load_settings() -> dict[str, Any]:
    """The saved settings, each field checked by ``_validated``; {} when there are none.

    A file that cannot be settings (not JSON, too big or deep, not an object) is moved aside to
    ``settings.json.corrupt`` with a warning, so the user can look at it and the next save starts clean.
    """
    path = settings_path()
    try:
        with open(path, "rb") as f:
            identity = os.fstat(f.fileno())
            blob = f.read(MAX_SETTINGS_BYTES + 1)
    except FileNotFoundError:
        return {}
    except OSError as e:
        _warn(f"cannot read {path} ({e.strerror or e}); using default settings")
        return {}
    try:
        data = _parse(blob)
    except ValueError as e:
        _move_aside(path, identity, str(e))
        return {}
    return _validated(data, path)


def _parse(blob: bytes) -> dict[str, Any]:
    if len(blob) > MAX_SETTINGS_BYTES:
        raise ValueError(f"larger than {MAX_SETTINGS_BYTES} bytes")
    text = blob.decode("utf-8")  # UnicodeDecodeError is a ValueError
    if _nesting(text) > MAX_DEPTH:
        raise ValueError(f"nested deeper than {MAX_DEPTH} levels")
    try:
        data = json.loads(text)
    except RecursionError:  # not a ValueError; the depth check should have caught it already
        raise ValueError("nested too deeply") from None
    if not isinstance(data, dict):
        raise ValueError(f"{_json_type(data)}, not an object")
    return data


def _nesting(text: str) -> int:
    """Bracket depth outside strings, without recursion (json.loads recurses, bounded by the caller's stack)."""
    depth = deepest = 0
    for m in _BRACKETS.finditer(text):
        c = m.group()
        if c in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in "]}":
            depth -= 1
    return deepest


def _move_aside(path: Path, identity: os.stat_result, why: str) -> None:
    aside = path.with_name(path.name + ".corrupt")
    try:
        now = os.stat(path)
        if (now.st_dev, now.st_ino) == (identity.st_dev, identity.st_ino):  # not replaced by a save meanwhile
            os.replace(path, aside)
    except FileNotFoundError:
        return  # another process moved it first
    except OSError as e:
        _warn(f"{path} is not valid settings ({why}); could not move it aside ({e.strerror or e}); ignoring it")
        return
    _warn(f"{path} is not valid settings ({why}); moved it to {aside} and started with default settings")


def _validated(data: dict[str, Any], path: Path) -> dict[str, Any]:
    """The one check of every field: known name, right type, sane range; anything else is dropped with a warning."""
    clean: dict[str, Any] = {}
    for name, value in data.items():
        check = _FIELDS.get(name)
        if check is None:
            _warn(f"{path}: unknown field {name!r} ignored", once=True)
            continue
        try:
            clean[name] = check(value, path)
        except ValueError as e:
            _warn(f"{path}: field {name!r} ignored: {e}", once=True)
    return clean


def _recent_models_field(value: Any, path: Path) -> list[str]:
    if not isinstance(value, list):
        raise ValueError(f"expected a list of paths, found {_json_type(value)}")
    models: list[str] = []
    for i, entry in enumerate(value):
        if len(models) == MAX_RECENT_MODELS:
            break
        if not isinstance(entry, str) or not entry or len(entry) > MAX_PATH_CHARS or "\x00" in entry:
            _warn(f"{path}: recent_models[{i}] ignored: not a usable path ({_json_type(entry)})", once=True)
        elif entry not in models:
            models.append(entry)
    return models


def _json_type(value: Any) -> str:
    if isinstance(value, str):
        return f"a string of {len(value)} characters"
    return {type(None): "null", bool: "a boolean", int: "a number", float: "a number", list: "a list"}.get(
        type(value), "an object"
    )


_FIELDS = {"recent_models": _recent_models_field}
# A whole string (skipped; an unterminated one runs to the end, keeping this linear) or one bracket.
_BRACKETS = re.compile(r'"(?:[^"\\]|\\.)*"?|[\[\]{}]', re.DOTALL)
_warned: set[str] = set()


def _warn(message: str, once: bool = False) -> None:
    """``once``: a field problem stays until the next save and the settings are read several times per run."""
    if once and message in _warned:
        return
    _warned.add(message)
    log.warning("perfx: %s", message)


def save_settings(settings: dict[str, Any]) -> None:
    """Write atomically (temporary file + rename), so a crash never leaves half a settings file."""
    path = settings_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".settings-", suffix=".json")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(settings, f, indent=2)
            f.flush()
            os.fsync(f.fileno())  # the rename must not land before the data
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def recent_models() -> list[str]:
    return list(load_settings().get("recent_models", []))


def remember_model(path: str | os.PathLike[str]) -> None:
    """Put ``path`` first in the recent-model list."""
    path = str(Path(path).resolve())
    settings = load_settings()
    models = [path] + [m for m in settings.get("recent_models", []) if m != path]
    settings["recent_models"] = models[:MAX_RECENT_MODELS]
    save_settings(settings)
