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

Two details keep a waiting job alive and the cache honest:

* Waiting is done in rounds (:func:`wait_for_lock`): rank 0 tries the lock without blocking every
  ``poll_s`` seconds and every rank joins one short broadcast per round. The other ranks therefore
  never sit in one collective for the whole conversion of the other job (tens of minutes for a
  30B model), which torch's process-group timeout (10 min by default for NCCL) would end.
* "Converted" means the conversion finished (:func:`converted`), not that ``iter_0000000`` exists:
  Megatron creates that folder when the save starts. A folder left by a conversion that was killed
  half way is renamed aside (never deleted) and the conversion runs again.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["file_lock", "wait_for_lock", "locked_model_import", "converted", "move_aside_partial"]

# Written last by a conversion (Megatron-Bridge's save_checkpoint, via bridge.save_megatron_model):
# Megatron's dist_checkpointing.save writes metadata.json after every shard ("only if the checkpoint is
# complete"), then Megatron-Bridge's rank 0 writes the train state, the tracker file and, last,
# run_config.yaml (the file NeMo-RL's loader reads).
COMPLETION_MARKERS = ("iter_0000000/metadata.json", "iter_0000000/run_config.yaml")


def _open_lock_file(path: str) -> int:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    return os.open(path, os.O_CREAT | os.O_RDWR, 0o644)


@contextmanager
def file_lock(path: str) -> Iterator[None]:
    """An exclusive ``flock`` on ``path`` (created if missing), held for the ``with`` block."""
    fd = _open_lock_file(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


@contextmanager
def wait_for_lock(path: str, *, rank0: bool, broadcast: Callable[[bool], bool], poll_s: float = 5.0,
                  log: Callable[[str], None] = print) -> Iterator[None]:
    """Rank 0 holds an exclusive ``flock`` on ``path`` for the ``with`` block; every rank enters it
    together. Why rounds: a rank that waited in one collective while rank 0 blocked on the lock
    would hit the process-group timeout when another job holds the lock longer than that; here
    rank 0 tries without blocking every ``poll_s`` seconds and all ranks join one broadcast of
    "got it?" per round, so no collective waits much longer than ``poll_s``."""
    fd = _open_lock_file(path) if rank0 else -1
    try:
        waited = False
        while True:
            got = False
            if rank0:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    got = True
                except BlockingIOError:
                    if not waited:
                        log(f"{path}: held by another job (converting this model); trying again every {poll_s:g} s")
                    waited = True
            if broadcast(got):
                break
            if rank0:
                time.sleep(poll_s)
        yield
    finally:
        if fd >= 0:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


def converted(pretrained_path: str) -> bool:
    """Whether a conversion into ``pretrained_path`` completed: the files it writes last are there
    (``COMPLETION_MARKERS``). NeMo-RL's own test (``validate_model_paths``: ``iter_0000000`` exists)
    also passes for a conversion killed half way, and every later job would then skip the import
    and fail to load."""
    return all(os.path.exists(os.path.join(pretrained_path, m)) for m in COMPLETION_MARKERS)


def move_aside_partial(pretrained_path: str, log: Callable[[str], None] = print) -> str | None:
    """Rename a folder that holds no completed conversion to ``<folder>.partial-<unix time>`` (never
    delete: it may be someone's work) so the conversion can write a fresh one; the new name, or None."""
    if not os.path.exists(pretrained_path) or converted(pretrained_path):
        return None
    aside = f"{pretrained_path.rstrip('/')}.partial-{int(time.time())}"
    os.rename(pretrained_path, aside)
    log(f"{pretrained_path}: an unfinished conversion (no {' / '.join(COMPLETION_MARKERS)}); moved to {aside}, "
        f"converting again")
    return aside


def locked_model_import(handle_model_import: Callable[..., Any], *, is_rank0: Callable[[], bool],
                        broadcast: Callable[[bool], bool], barrier: Callable[[], None],
                        log: Callable[[str], None] = print, poll_s: float = 5.0) -> Callable[..., Any]:
    """``handle_model_import`` (NeMo-RL's signature: ``config, hf_model_name, pretrained_path,
    pt_checkpoint_exists, **hooks``) under the cache folder's lock. ``broadcast`` sends rank 0's
    bool to every rank, ``barrier`` waits for all ranks (``torch.distributed`` in the worker);
    ``poll_s``: seconds between two tries of the lock (keep it well under the process-group timeout)."""

    def wrapper(config, hf_model_name, pretrained_path, pt_checkpoint_exists, *args, **kwargs):
        if (config.get("pretrained_checkpoint") or {}).get("format", "hf") != "hf":
            # a user's Megatron checkpoint (policy.pretrained_checkpoint): NeMo-RL converts nothing,
            # and pretrained_path is that checkpoint, not the conversion cache: never move it
            return handle_model_import(config, hf_model_name, pretrained_path, pt_checkpoint_exists, *args, **kwargs)
        rank0 = is_rank0()
        lock = pretrained_path.rstrip("/") + ".lock"
        with wait_for_lock(lock, rank0=rank0, broadcast=broadcast, poll_s=poll_s, log=log):
            done = False
            if rank0:
                done = converted(pretrained_path)
                if not done:
                    move_aside_partial(pretrained_path, log)
            exists = broadcast(done)
            if exists and not pt_checkpoint_exists and rank0:
                log(f"{pretrained_path}: converted by another job while this one waited for {lock}")
            result = handle_model_import(config, hf_model_name, pretrained_path, exists, *args, **kwargs)
            barrier()
        return result

    return wrapper
