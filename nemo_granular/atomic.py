"""Files that a reader, a crash or a second writer never sees half written: each write goes to a temporary file
beside the target (same folder, so the same file system), then one ``os.replace`` puts it in place.

The temporary name carries the host and the process id: two processes on two nodes writing the same file on a
shared file system never write into one temporary file. It keeps the target's extension, for writers that choose
the format by it (matplotlib's ``savefig``). A write that fails removes its temporary file and leaves the target
as it was. (``nemo_rl/conversion_lock.py`` keeps its own two lines: it imports nothing of the package, so that a
Megatron worker's venv can load it from its file.)
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from pathlib import Path


def temporary_name(path: Path) -> Path:
    """``<folder>/.<stem>.tmp-<host>-<pid><suffix>`` for ``path``."""
    return path.with_name(f".{path.stem}.tmp-{socket.gethostname()}-{os.getpid()}{path.suffix}")


def write_with(path, write: Callable[[Path], object], *, fsync: bool = False) -> Path:
    """``write(tmp)`` writes the content to the temporary file it is given; then (``fsync``: after flushing it
    to the disk) the temporary file replaces ``path``. Returns ``path``."""
    path = Path(path)
    tmp = temporary_name(path)
    try:
        write(tmp)
        if fsync:
            with open(tmp, "rb") as fh:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def write_text(path, text: str, *, fsync: bool = False) -> Path:
    """``text`` into ``path`` (UTF-8), atomically."""
    return write_with(path, lambda tmp: tmp.write_text(text, encoding="utf-8"), fsync=fsync)
