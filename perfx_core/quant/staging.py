"""An output directory that appears whole or not at all: built beside its place, synced, then renamed in.

The directory being built, ``.OUT.partial-XXXX``, is flock()ed by its run for as long as the run lives, so a
later run can tell a killed run's leftover (lock free) from one in use, and removes it.
"""

from __future__ import annotations

import ctypes
import errno
import os
import secrets
import shutil
import time
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no flock, so leftovers are not recognised (and not removed)
    fcntl = None  # type: ignore[assignment]

# An empty, unlocked partial directory may be one another run has just made and not yet locked.
EMPTY_GRACE_S = 60.0
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def partial_prefix(out: Path) -> str:
    return f".{out.name}.partial-"


class StagedDirectory:
    """A new, empty directory beside ``out``, locked until ``close``; ``publish`` moves it to ``out``."""

    def __init__(self, out: Path):
        self.out = out
        self.path, self._fd = _make_locked(out)

    def publish(self) -> None:
        publish(self.path, self.out)

    def discard(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # releases the lock
            self._fd = -1


def _make_locked(out: Path) -> tuple[Path, int]:
    while True:
        path = out.parent / (partial_prefix(out) + secrets.token_hex(4))
        try:
            os.mkdir(path)  # mode 0o777 & ~umask, like any directory (tempfile.mkdtemp would make it 0700)
        except FileExistsError:
            continue
        if fcntl is None:
            return path, -1
        fd = os.open(path, os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_EX)  # waits only while a cleaner looks at the still empty directory
        return path, fd


def remove_stale(out: Path) -> list[Path]:
    """Remove the partial directories of ``out`` that no live run holds; returns them."""
    if fcntl is None:
        return []
    removed = []
    for path in out.parent.iterdir():
        if not path.name.startswith(partial_prefix(out)):
            continue
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
            continue  # gone meanwhile, or not a directory
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue  # a live run
        try:
            with os.scandir(fd) as entries:
                used = any(entries)  # a run writes only once it holds the lock: now it is gone
            if used or time.time() - os.fstat(fd).st_mtime > EMPTY_GRACE_S:
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
        finally:
            os.close(fd)
    return removed


def publish(staged: Path, out: Path) -> None:
    """Make ``staged`` durable and put it at ``out``; an existing ``out`` is swapped out in one step."""
    _sync_tree(staged)
    if not out.exists():
        os.rename(staged, out)
    elif _exchange(staged, out):
        shutil.rmtree(staged, ignore_errors=True)  # now the previous output
    else:  # no atomic exchange here: move the old one aside first (OUT is briefly missing)
        aside = out.parent / (partial_prefix(out) + secrets.token_hex(4))
        os.rename(out, aside)
        try:
            os.rename(staged, out)
        except BaseException:
            os.rename(aside, out)
            raise
        shutil.rmtree(aside, ignore_errors=True)
    _fsync(out.parent)


def _sync_tree(root: Path) -> None:
    """fsync every file, then every directory (deepest first): a rename must never publish unwritten data."""
    for directory, _dirs, files in os.walk(root, topdown=False):
        for name in files:
            _fsync(Path(directory) / name)
        _fsync(Path(directory))


def _fsync(path: Path) -> None:
    if os.name == "nt" and path.is_dir():
        return  # Windows cannot open a directory to sync it
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux renameat2); False where the C library or file system cannot."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError, TypeError):
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))
