"""What every ``nemo-granular`` command shares: argparse with one-line errors, the exit codes, the
command that runs the tool again as printed, the check that an output directory can be written before
any work starts, and the process umask.

A leaf module (it imports nothing else of the package): the commands import it, never the
dispatcher ``nemo_granular.cli`` above them (tests/test_layering.py).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
from pathlib import Path

INTERRUPTED_EXIT_CODE = 130


class ArgumentParser(argparse.ArgumentParser):
    """argparse with a one-line error (no usage block) and exit code 2; no abbreviated options."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def command_prefix() -> str:
    """How to run ``nemo-granular`` again, as a shell word that works as printed from any directory:
    ``nemo-granular`` when that name on PATH is this installation's console script, else the script's
    absolute path (``/path/to/.venv/bin/nemo-granular``: the quick start does not activate the venv),
    else ``<python> -m nemo_granular``."""
    script = Path(sys.executable).parent / "nemo-granular"
    on_path = shutil.which("nemo-granular")
    if script.is_file():
        if on_path and Path(on_path).resolve() == script.resolve():
            return "nemo-granular"
        return shlex.quote(str(script.absolute()))
    return f"{shlex.quote(str(Path(sys.executable).absolute()))} -m nemo_granular"


def current_umask() -> int:
    """The process umask, read without changing it (Linux: ``/proc/self/status``). Setting it to 0
    and back, the only portable way, lets another thread (a TensorBoard writer) create
    world-writable files in between; that is the fallback where /proc has no ``Umask:`` line."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0)
    os.umask(mask)
    return mask


def check_writable_dir(path: str | Path, option: str) -> None:
    """Refuse, in one line naming ``option``, an output directory that cannot be created or written:
    a file (or a path under one), a read-only file system, a folder without write permission.

    Only reads: the nearest existing ancestor decides whether the missing folders can be created.
    """
    path = Path(path)
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        where = "is a file" if existing == path else f"is under {existing}, which is a file"
        raise NotADirectoryError(f"{option} {path}: {where}, not a directory")
    try:
        read_only = bool(os.statvfs(existing).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    if read_only:
        raise PermissionError(f"{option} {path}: {existing} is on a read-only file system")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise PermissionError(f"{option} {path}: no permission to write in {existing}")
