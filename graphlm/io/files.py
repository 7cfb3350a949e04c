"""Reading a file the way every graphlm loader does: regular files only, bounded reads.

`read_regular(path, what)` refuses what is not a regular file (a FIFO would block the read
forever, /dev/zero would never end, a directory is not data) before reading anything: the file
is opened non-blocking and checked with fstat on the open descriptor, so it cannot be swapped
between the check and the read. It then reads at most the size fstat reported (and at most
`max_bytes`), so no file can make a loader allocate more than it declared. Errors are one
ValueError naming `what` and the path.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def read_regular(path: str | os.PathLike, what: str, max_bytes: int | None = None) -> bytes:
    """The bytes of the regular file at `path` (`what` names it in errors, e.g. "data file")."""
    path = Path(path)
    where = f"{what} {path}"
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise ValueError(f"{where}: no such file") from None
    except IsADirectoryError:
        raise ValueError(f"{where}: is a directory, expected a file") from None
    except OSError as e:
        raise ValueError(f"{where}: cannot read it ({e.strerror or e})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{where}: is {_kind(st.st_mode)}, expected a regular file")
        size = st.st_size
        if max_bytes is not None and size > max_bytes:
            raise ValueError(f"{where}: {size:,} bytes, more than the {max_bytes:,} this reader accepts")
        chunks, left = [], size
        try:
            while left > 0:
                chunk = os.read(fd, min(left, 1 << 24))
                if not chunk:   # (shrunk while being read)
                    break
                chunks.append(chunk)
                left -= len(chunk)
        except OSError as e:
            raise ValueError(f"{where}: cannot read it ({e.strerror or e})") from None
        return b"".join(chunks)
    finally:
        os.close(fd)


__all__ = ["read_regular"]
