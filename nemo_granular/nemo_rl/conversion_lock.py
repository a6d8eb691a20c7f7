"""One HF→Megatron conversion at a time per cache folder, across jobs.

NeMo-RL's Megatron worker converts the HF model into ``$HF_HOME/nemo_rl/<model>`` (or
``NRL_MEGATRON_CHECKPOINT_DIR``) when ``<that>/iter_0000000`` does not exist
(``nemo_rl/models/megatron/setup.py:handle_model_import``), with no lock: two jobs started side by
side on a fresh cache (the ESPO and GSPO runs of a comparison) both convert into the same folder.
:func:`locked_model_import` wraps ``handle_model_import``: rank 0 of the job takes an exclusive
``flock`` on ``<folder>.lock`` (next to the folder, on the same shared file system), checks again
whether the converted checkpoint is there now, tells every rank, and all ranks run NeMo-RL's import
with that answer (the conversion is collective) before rank 0 releases the lock. A job that waited
finds the other's checkpoint and skips the import. ``flock`` must work across nodes on that file
system (Lustre: mounted with ``-o flock``; NFSv4 and GPFS: yes).
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

__all__ = ["file_lock", "locked_model_import", "converted"]


@contextmanager
def file_lock(path: str) -> Iterator[None]:
    """An exclusive ``flock`` on ``path`` (created if missing), held for the ``with`` block."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def converted(pretrained_path: str) -> bool:
    """NeMo-RL's own test for a converted checkpoint (``validate_model_paths``)."""
    return os.path.exists(pretrained_path) and os.path.exists(os.path.join(pretrained_path, "iter_0000000"))


def locked_model_import(handle_model_import: Callable[..., Any], *, is_rank0: Callable[[], bool],
                        broadcast: Callable[[bool], bool], barrier: Callable[[], None],
                        log: Callable[[str], None] = print) -> Callable[..., Any]:
    """``handle_model_import`` (NeMo-RL's signature: ``config, hf_model_name, pretrained_path,
    pt_checkpoint_exists, **hooks``) under the cache folder's lock. ``broadcast`` sends rank 0's
    bool to every rank, ``barrier`` waits for all ranks (``torch.distributed`` in the worker)."""

    def wrapper(config, hf_model_name, pretrained_path, pt_checkpoint_exists, *args, **kwargs):
        rank0 = is_rank0()
        lock = pretrained_path.rstrip("/") + ".lock"
        with file_lock(lock) if rank0 else nullcontext():
            exists = broadcast(converted(pretrained_path) if rank0 else False)
            if exists and not pt_checkpoint_exists and rank0:
                log(f"{pretrained_path}: converted by another job while this one waited for {lock}")
            result = handle_model_import(config, hf_model_name, pretrained_path, exists, *args, **kwargs)
            barrier()
        return result

    return wrapper
