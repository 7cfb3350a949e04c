"""Ownership of folders on disk: the run lock and the clean-up of dead processes' temporaries.

`RunLock(folder)` makes a run folder belong to one process: an exclusive ``flock`` on
``folder/run.lock``, taken before anything in the folder is read or written and held until the
run ends. The kernel drops the lock when its holder dies (exit, crash, SIGKILL), so a stale lock
file of a dead process is detected by the lock itself, never by guessing; the file's JSON (pid,
host, start time, command) is only for the message a second run gets:

    run folder runs/x is in use by pid 4711 on host (graphlm train --out runs/x, since 12:03:01)

Temporary files are named ``<stem>.tmp-<pid>`` (or ``<stem>-<pid>-...`` for folders); the
`remove_dead_temporaries` sweep deletes those whose process is gone, so kill -9 during a save
leaks nothing for long.
"""
from __future__ import annotations

import errno
import json
import os
import re
import shutil
import socket
import sys
import time
from pathlib import Path

try:
    import fcntl
except ImportError:   # (not POSIX: no advisory locks; RunLock then refuses to run)
    fcntl = None

LOCK_NAME = "run.lock"


class RunFolderBusy(ValueError):
    """Another live process holds the run folder's lock."""


def pid_alive(pid: int) -> bool:
    """Whether a process with this id exists (on this host)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # it exists, under another user
        return True
    return True


class RunLock:
    """An exclusive lock on a run folder, held from `acquire` to `release` (a context manager).

    `acquire` creates the folder if needed and fails at once (no waiting) with `RunFolderBusy`
    naming the folder and the holder when another live process holds it. `stale` tells whether a
    lock file left by a dead process was found (and taken over)."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        self.path = self.folder / LOCK_NAME
        self._fd: int | None = None
        self.stale: dict | None = None

    def acquire(self) -> "RunLock":
        if fcntl is None:
            raise ValueError(f"run folder {self.folder}: file locks are not available on this platform")
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError as e:
            raise ValueError(f"run folder {self.folder}: cannot create its lock file "
                             f"{self.path.name} ({e.strerror or e})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _read_holder(fd)
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise ValueError(f"run folder {self.folder}: cannot lock {self.path.name} "
                                 f"({e.strerror or e})") from None
            raise RunFolderBusy(f"run folder {self.folder} is in use by {_describe(holder)}; wait "
                                "for that run to end or choose another --out") from None
        previous = _read_holder(fd)
        if previous.get("pid") not in (None, os.getpid()):
            self.stale = previous   # a lock file whose holder died without unlocking
        prog = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"
        if prog == "__main__.py":   # python -m graphlm
            prog = "graphlm"
        info = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(),
                "command": " ".join([prog, *sys.argv[1:]])}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            try:
                os.ftruncate(self._fd, 0)   # (a released lock names no holder)
            except OSError:
                pass
            os.close(self._fd)              # closing drops the flock
            self._fd = None

    def __enter__(self) -> "RunLock":
        return self.acquire() if self._fd is None else self

    def __exit__(self, *exc) -> None:
        self.release()


def _read_holder(fd: int) -> dict:
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        return info if isinstance(info, dict) else {}
    except (OSError, ValueError):
        return {}


def _describe(holder: dict) -> str:
    if not isinstance(holder.get("pid"), int):
        return "another process (its lock file names none yet)"
    since = holder.get("since")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) if isinstance(since, (int, float)) else "?"
    return (f"pid {holder['pid']} on {holder.get('host', '?')} ({str(holder.get('command', '?'))[:200]}, "
            f"since {when})")


_PID_SUFFIX = re.compile(r"\.tmp-(\d+)$|-(\d+)-[^/]*$")


def remove_dead_temporaries(folder: str | os.PathLike, prefix: str) -> list[Path]:
    """Delete the files and folders in `folder` named ``prefix...tmp-PID`` or ``prefix...-PID-...``
    whose process PID is no longer alive; returns what was removed. Errors are ignored (another
    process may be sweeping too)."""
    removed = []
    try:
        entries = list(Path(folder).iterdir())
    except OSError:
        return removed
    for entry in entries:
        if not entry.name.startswith(prefix):
            continue
        m = _PID_SUFFIX.search(entry.name)
        if m is None:
            continue
        pid = int(m.group(1) or m.group(2))
        if pid == os.getpid() or pid_alive(pid):
            continue
        try:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
            removed.append(entry)
        except OSError:
            pass
    return removed


__all__ = ["RunLock", "RunFolderBusy", "LOCK_NAME", "pid_alive", "remove_dead_temporaries"]
