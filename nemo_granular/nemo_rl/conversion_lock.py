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

Where it does not, ``flock`` is no lock at all: on Lustre mounted ``localflock`` it is node-local (two
jobs on two nodes both get it), with ``noflock`` (or neither option) it fails, and NFS without a lock
manager answers ``ENOLCK``. So rank 0 decides at lock time (:class:`ConversionLock`): the mount that
holds the lock path (:func:`mount_for_path`, from ``/proc/mounts``) and its options
(:func:`flock_verdict`) say whether ``flock`` is trusted there, and an ``flock`` that fails with
``ENOSYS``/``EINVAL``/``EOPNOTSUPP``/``ENOLCK`` is not. Where it is not, the lock is a directory,
``<folder>.lock.d`` (:class:`DirectoryLock`): created by one atomic rename, holding an owner record
(host, pid, Slurm job, heartbeat) that the holder refreshes every ``HEARTBEAT_SECONDS``; a waiter
takes it over only when the heartbeat is older than ``NG_CONVERSION_LOCK_STALE_SECONDS`` (default
600). One line says which lock is used and why.

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

import errno
import fcntl
import json
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

__all__ = [
    "file_lock",
    "wait_for_lock",
    "locked_model_import",
    "converted",
    "move_aside_partial",
    "ConversionLock",
    "DirectoryLock",
    "Mount",
    "parse_mounts",
    "mount_for_path",
    "flock_verdict",
    "lock_kind_for",
    "stale_seconds",
    "FLOCK",
    "DIRECTORY",
    "STALE_SECONDS_ENV",
]

# Written last by a conversion (Megatron-Bridge's save_checkpoint, via bridge.save_megatron_model):
# Megatron's dist_checkpointing.save writes metadata.json after every shard ("only if the checkpoint is
# complete"), then Megatron-Bridge's rank 0 writes the train state, the tracker file and, last,
# run_config.yaml (the file NeMo-RL's loader reads).
COMPLETION_MARKERS = ("iter_0000000/metadata.json", "iter_0000000/run_config.yaml")

FLOCK = "flock"
DIRECTORY = "directory"
LOCK_KINDS = (FLOCK, DIRECTORY)
STALE_SECONDS_ENV = "NG_CONVERSION_LOCK_STALE_SECONDS"
DEFAULT_STALE_SECONDS = 600.0
# the holder rewrites its owner record this often; a stale threshold must leave room for a few missed beats
HEARTBEAT_SECONDS = 30.0
MIN_STALE_SECONDS = 2 * HEARTBEAT_SECONDS
# flock() errors that mean "no (cross-node) flock on this file system", not "held by someone": Lustre
# mounted noflock answers ENOSYS (older clients) or EINVAL/EOPNOTSUPP (newer); NFS without lockd ENOLCK
FLOCK_UNSUPPORTED_ERRNOS = frozenset({errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOLCK})
OWNER_RECORD = "owner.json"


# ---------------------------------------------------------------- which lock: the mount of the lock path


@dataclass(frozen=True)
class Mount:
    """One line of ``/proc/mounts``: where it is mounted, the file system type, the mount options."""

    point: str
    fstype: str
    options: tuple[str, ...]


def _unescape_mount_field(field: str) -> str:
    """``/proc/mounts`` writes space, tab, newline and backslash in paths as octal escapes (``\\040``)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def parse_mounts(mounts_text: str) -> list[Mount]:
    """The mounts of a ``/proc/mounts`` text, in its order (lines too short to be mounts are skipped)."""
    mounts = []
    for line in mounts_text.splitlines():
        fields = line.split()
        if len(fields) >= 4:
            mounts.append(Mount(_unescape_mount_field(fields[1]), fields[2], tuple(fields[3].split(","))))
    return mounts


def _is_under(path: str, point: str) -> bool:
    """Whether ``path`` is the mount point ``point`` or below it (``/lustre2`` is not under ``/lustre``)."""
    point = point.rstrip("/")
    return point == "" or path == point or path.startswith(point + "/")


def mount_for_path(real_path: str, mounts_text: str) -> Mount | None:
    """The mount holding ``real_path`` (symlinks already resolved): the longest mount point that is it or
    one of its parents; of two at the same point the later one, which hides the earlier."""
    best: Mount | None = None
    for mount in parse_mounts(mounts_text):
        if _is_under(real_path, mount.point) and (best is None or len(mount.point) >= len(best.point)):
            best = mount
    return best


def _option_value(options: tuple[str, ...], name: str) -> str | None:
    """The value of ``name=value`` among mount options, or None."""
    for option in options:
        if option.startswith(name + "="):
            return option.split("=", 1)[1]
    return None


def flock_verdict(mount: Mount | None) -> tuple[bool, str]:
    """Whether an ``flock`` on this mount also excludes processes on other nodes, and why, as the middle
    of the log line ("is on lustre (/lustre) mounted localflock: flock is node-local there")."""
    if mount is None:
        return True, "is on no mount listed in /proc/mounts: flock is trusted"
    where = f"is on {mount.fstype} ({mount.point})"
    if mount.fstype == "lustre":
        # Lustre's client keeps flock local (localflock) or refuses it (noflock) unless mounted -o flock
        if "flock" in mount.options:
            return True, f"{where} mounted flock: flock works across nodes there"
        if "localflock" in mount.options:
            return False, f"{where} mounted localflock: flock is node-local there"
        mode = "noflock" if "noflock" in mount.options else "without flock"
        return False, f"{where} mounted {mode}: flock is not supported there"
    if mount.fstype.startswith("nfs"):
        # nolock / local_lock=flock|all: the NFS client keeps flock on this node, the server never sees it
        local_lock = _option_value(mount.options, "local_lock")
        if "nolock" in mount.options or local_lock in ("flock", "all"):
            mode = "nolock" if "nolock" in mount.options else f"local_lock={local_lock}"
            return False, f"{where} mounted {mode}: flock is node-local there"
    return True, f"{where}: flock is trusted there"


def _read_proc_mounts() -> str:
    """``/proc/mounts``, or "" where there is none (not Linux): flock is then trusted."""
    try:
        with open("/proc/mounts", encoding="utf-8", errors="surrogateescape") as f:
            return f.read()
    except OSError:
        return ""


def lock_kind_for(lock_path: str, mounts_text: str) -> tuple[str, str]:
    """``(FLOCK or DIRECTORY, why)`` for a lock at ``lock_path``, whose folder exists: the verdict on the
    mount that holds its real path (symlinks resolved: ``/scratch`` may be a link into Lustre)."""
    real = os.path.realpath(lock_path)
    trusted, why = flock_verdict(mount_for_path(real, mounts_text))
    return (FLOCK if trusted else DIRECTORY), why


def stale_seconds(environ: Mapping[str, str] = os.environ) -> float:
    """Seconds without a heartbeat after which a directory lock is taken over: ``STALE_SECONDS_ENV``, else
    ``DEFAULT_STALE_SECONDS``; under ``MIN_STALE_SECONDS`` a live holder could lose its lock, so refused."""
    value = environ.get(STALE_SECONDS_ENV, "").strip()
    if not value:
        return DEFAULT_STALE_SECONDS
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"{STALE_SECONDS_ENV}={value!r}: not a number of seconds") from None
    if not seconds >= MIN_STALE_SECONDS:
        raise ValueError(
            f"{STALE_SECONDS_ENV}={value!r}: at least {MIN_STALE_SECONDS:g} s (two heartbeats of the "
            f"lock's holder), or a live holder's lock would be taken over"
        )
    return seconds


# ---------------------------------------------------------------- the two locks


def _open_lock_file(path: str) -> int:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    return os.open(path, os.O_CREAT | os.O_RDWR, 0o644)


class _FlockLock:
    """An exclusive ``flock`` on a lock file (created if missing)."""

    kind = FLOCK

    def __init__(self, path: str):
        self.path = path
        self._fd = _open_lock_file(path)

    def try_acquire(self) -> bool:
        """True when taken now, False when someone holds it; other ``OSError``s (no flock here) pass up."""
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False

    def acquire_blocking(self) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_EX)

    def holder(self) -> str:
        return ""  # flock does not say who

    def release(self) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        os.close(self._fd)


def _read_owner(lock_dir: str) -> dict | None:
    """The owner record in ``lock_dir``, or None (no such directory, no record, not a record)."""
    try:
        with open(os.path.join(lock_dir, OWNER_RECORD), encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _write_owner(lock_dir: str, record: dict) -> None:
    """Write the owner record atomically (a temporary file renamed over it): a reader sees the old or
    the new record, never half of one."""
    tmp = os.path.join(lock_dir, f"{OWNER_RECORD}.tmp-{record['token']}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(record, f)
    os.replace(tmp, os.path.join(lock_dir, OWNER_RECORD))


def describe_owner(record: dict | None) -> str:
    """``host <h> pid <p> (Slurm job <j>)`` for log lines; ``an unknown owner`` without a record."""
    if not record:
        return "an unknown owner"
    job = f" (Slurm job {record['slurm_job_id']})" if record.get("slurm_job_id") else ""
    return f"host {record.get('host', '?')} pid {record.get('pid', '?')}{job}"


def _remove_tree_of_files(path: str) -> None:
    """Remove a lock directory (files only inside); what is already gone is fine."""
    try:
        names = os.listdir(path)
    except FileNotFoundError:
        return
    for name in names:
        try:
            os.unlink(os.path.join(path, name))
        except FileNotFoundError:
            pass
    try:
        os.rmdir(path)
    except FileNotFoundError:
        pass


class DirectoryLock:
    """A lock that works on any POSIX shared file system: the directory ``path`` with an owner record.

    Taken by renaming a staged directory, record already inside, onto ``path``: ``rename`` is atomic
    and fails onto a directory that is not empty, so exactly one of several takers wins, and ``path``
    is never an empty (ownerless) directory while held. The holder rewrites its record's heartbeat
    every ``heartbeat_s`` from a thread. A waiter takes the lock over only when that heartbeat is older
    than ``stale_s``: it renames the stale directory aside to ``<path>.stale-<owner token>`` (kept, with
    the record, for whoever wonders; a second waiter's rename onto that name fails) and logs one line
    naming the stale owner. Release moves the directory aside and removes it, only while the record
    is still this holder's: someone else's live lock is never removed.
    """

    kind = DIRECTORY

    def __init__(
        self,
        path: str,
        *,
        stale_s: float | None = None,
        heartbeat_s: float = HEARTBEAT_SECONDS,
        log: Callable[[str], None] = print,
    ):
        self.path = path.rstrip("/")
        self.stale_s = stale_seconds() if stale_s is None else stale_s
        self.heartbeat_s = heartbeat_s
        self.log = log
        self._record: dict | None = None  # this holder's record while held
        self._stop = threading.Event()
        self._beater: threading.Thread | None = None

    def _new_record(self) -> dict:
        now = time.time()
        return {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            "token": f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:12]}",
            "acquired": now,
            "heartbeat": now,
        }

    def _claim(self) -> bool:
        """One atomic attempt to create the lock directory with a fresh record of ours."""
        record = self._new_record()
        staged = f"{self.path}.new-{record['token']}"
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        os.mkdir(staged)
        try:
            _write_owner(staged, record)
            os.rename(staged, self.path)
        except OSError as e:
            _remove_tree_of_files(staged)
            # NFS may answer a retransmitted rename that did succeed with ENOENT: the record says
            if (_read_owner(self.path) or {}).get("token") == record["token"]:
                return self._held(record)
            if e.errno in (errno.EEXIST, errno.ENOTEMPTY):
                return False
            raise
        return self._held(record)

    def _held(self, record: dict) -> bool:
        self._record = record
        self._stop.clear()
        self._beater = threading.Thread(target=self._beat, name=f"heartbeat {self.path}", daemon=True)
        self._beater.start()
        return True

    def _beat(self) -> None:
        """Refresh the heartbeat until released; stop when the record is no longer ours (taken over)."""
        while not self._stop.wait(self.heartbeat_s):
            current = _read_owner(self.path)
            if current is None or current.get("token") != self._record["token"]:
                self.log(
                    f"conversion lock: {self.path} was taken over by {describe_owner(current)} while this job "
                    f"held it (its heartbeat was found stale)"
                )
                return
            try:
                _write_owner(self.path, {**self._record, "heartbeat": time.time()})
            except OSError:
                pass  # a passing file-system hiccup: the next beat tries again, well before stale_s

    def heartbeat_age(self, record: dict | None) -> float | None:
        """Seconds since the holder's last heartbeat (the directory's change time without a record), or
        None when there is no lock directory."""
        if record is not None and isinstance(record.get("heartbeat"), (int, float)):
            return time.time() - record["heartbeat"]
        try:
            return time.time() - os.stat(self.path).st_mtime
        except FileNotFoundError:
            return None

    def _take_over(self, record: dict | None, age: float) -> bool:
        """Move the stale lock directory aside; False when someone else moved or replaced it first."""
        token = (record or {}).get("token")
        if token is None:
            try:
                token = f"ino{os.stat(self.path).st_ino}"
            except FileNotFoundError:
                return False
        aside = f"{self.path}.stale-{token}"
        try:
            os.rename(self.path, aside)
        except OSError as e:
            if e.errno in (errno.ENOENT, errno.EEXIST, errno.ENOTEMPTY):
                return False  # released meanwhile, or another waiter took it over first
            raise
        moved = _read_owner(aside)
        if record is not None and (moved or {}).get("token") != token:
            # a new holder's live lock got there between our look and our rename: give it back
            try:
                os.rename(aside, self.path)
            except OSError:
                pass
            return False
        self.log(
            f"conversion lock: {self.path}: taking over the lock of {describe_owner(record)}, whose last "
            f"heartbeat is {age:.0f} s old (over {self.stale_s:g} s, "
            f"{STALE_SECONDS_ENV}); its directory is kept as {aside}"
        )
        return True

    def try_acquire(self) -> bool:
        """True when taken now (also by taking over a stale lock), False when someone else holds it."""
        if self._claim():
            return True
        record = _read_owner(self.path)
        age = self.heartbeat_age(record)
        if age is not None and age > self.stale_s and self._take_over(record, age):
            return self._claim()
        return False

    def holder(self) -> str:
        return describe_owner(_read_owner(self.path))

    def release(self) -> None:
        """Stop the heartbeat, then remove the lock directory if it is still ours."""
        self._stop.set()
        if self._beater is not None:
            self._beater.join()
        record, self._record, self._beater = self._record, None, None
        if record is None:
            return
        current = _read_owner(self.path)
        if (current or {}).get("token") != record["token"]:
            self.log(
                f"conversion lock: {self.path} is held by {describe_owner(current)} now (this job's lock was "
                f"taken over): left as it is"
            )
            return
        gone = f"{self.path}.released-{record['token']}"
        os.rename(self.path, gone)  # away from the lock's name first: never an empty directory there
        _remove_tree_of_files(gone)

    def close(self) -> None:
        pass


class ConversionLock:
    """The lock at ``path`` (``<folder>.lock``): ``flock`` on it where that is trusted across nodes, else a
    :class:`DirectoryLock` at ``<path>.d``; ``kind`` forces one (tests). Logs one line saying which and why,
    and switches to the directory lock (another line) when ``flock`` turns out not to be supported."""

    def __init__(
        self,
        path: str,
        *,
        kind: str | None = None,
        log: Callable[[str], None] = print,
        mounts_text: str | None = None,
        stale_s: float | None = None,
        heartbeat_s: float = HEARTBEAT_SECONDS,
    ):
        if kind not in (None, *LOCK_KINDS):
            raise ValueError(f"lock kind {kind!r}: one of {', '.join(LOCK_KINDS)}")
        self.path, self.log = path, log
        self._directory_args = {"stale_s": stale_s, "heartbeat_s": heartbeat_s, "log": log}
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        if kind is None:
            kind, why = lock_kind_for(path, _read_proc_mounts() if mounts_text is None else mounts_text)
        else:
            why = f"is to use the {kind} lock (asked for by the caller)"
        self._lock: _FlockLock | DirectoryLock
        if kind == FLOCK:
            self._lock = _FlockLock(path)
            log(f"conversion lock: {path} {why}; using flock")
        else:
            self._lock = DirectoryLock(f"{path}.d", **self._directory_args)
            log(f"conversion lock: {path} {why}; using a lock directory with a heartbeat ({self._lock.path})")

    @property
    def kind(self) -> str:
        return self._lock.kind

    @property
    def lock_path(self) -> str:
        """The file or directory that is the lock."""
        return self._lock.path

    def try_acquire(self) -> bool:
        """True when taken now, False when held by another job."""
        try:
            return self._lock.try_acquire()
        except OSError as e:
            if self._lock.kind != FLOCK or e.errno not in FLOCK_UNSUPPORTED_ERRNOS:
                raise
            self._lock.close()
            self._lock = DirectoryLock(f"{self.path}.d", **self._directory_args)
            self.log(
                f"conversion lock: flock on {self.path} failed ({errno.errorcode.get(e.errno, e.errno)}: "
                f"{e.strerror}): no flock on this file system; using a lock directory with a heartbeat "
                f"({self._lock.path})"
            )
            return self._lock.try_acquire()

    def acquire(self, poll_s: float = 1.0) -> None:
        """Wait until taken: ``flock`` blocks, the directory lock is tried every ``poll_s`` seconds."""
        while not self.try_acquire():
            if isinstance(self._lock, _FlockLock):
                self._lock.acquire_blocking()
                return
            time.sleep(poll_s)

    def holder(self) -> str:
        """Who holds it, for the waiting line ("" when the lock does not say)."""
        return self._lock.holder()

    def release(self) -> None:
        self._lock.release()

    def close(self) -> None:
        self._lock.close()


@contextmanager
def file_lock(
    path: str, *, kind: str | None = None, log: Callable[[str], None] = print, poll_s: float = 1.0
) -> Iterator[None]:
    """The lock at ``path`` (:class:`ConversionLock`: ``flock``, or the directory lock where ``flock`` is not
    trusted across nodes), held for the ``with`` block."""
    lock = ConversionLock(path, kind=kind, log=log)
    try:
        lock.acquire(poll_s)
        try:
            yield
        finally:
            lock.release()
    finally:
        lock.close()


@contextmanager
def wait_for_lock(
    path: str,
    *,
    rank0: bool,
    broadcast: Callable[[bool], bool],
    poll_s: float = 5.0,
    log: Callable[[str], None] = print,
    kind: str | None = None,
) -> Iterator[None]:
    """Rank 0 holds the lock at ``path`` (:class:`ConversionLock`) for the ``with`` block; every rank enters
    it together. Why rounds: a rank that waited in one collective while rank 0 blocked on the lock
    would hit the process-group timeout when another job holds the lock longer than that; here
    rank 0 tries without blocking every ``poll_s`` seconds and all ranks join one broadcast of
    "got it?" per round, so no collective waits much longer than ``poll_s``. ``kind`` forces the
    lock's kind (tests)."""
    lock = ConversionLock(path, kind=kind, log=log) if rank0 else None
    held = False
    try:
        waited = False
        while True:
            if lock is not None:
                held = lock.try_acquire()
                if not held and not waited:
                    holder = lock.holder()
                    log(
                        f"{lock.lock_path}: held by another job{f' ({holder})' if holder else ''} (converting this "
                        f"model); trying again every {poll_s:g} s"
                    )
                    waited = True
            if broadcast(held):
                break
            if lock is not None:
                time.sleep(poll_s)
        yield
    finally:
        if lock is not None:
            if held:
                lock.release()
            lock.close()


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
    log(
        f"{pretrained_path}: an unfinished conversion (no {' / '.join(COMPLETION_MARKERS)}); moved to {aside}, "
        f"converting again"
    )
    return aside


def locked_model_import(
    handle_model_import: Callable[..., Any],
    *,
    is_rank0: Callable[[], bool],
    broadcast: Callable[[bool], bool],
    barrier: Callable[[], None],
    log: Callable[[str], None] = print,
    poll_s: float = 5.0,
    lock_kind: str | None = None,
) -> Callable[..., Any]:
    """``handle_model_import`` (NeMo-RL's signature: ``config, hf_model_name, pretrained_path,
    pt_checkpoint_exists, **hooks``) under the cache folder's lock. ``broadcast`` sends rank 0's
    bool to every rank, ``barrier`` waits for all ranks (``torch.distributed`` in the worker);
    ``poll_s``: seconds between two tries of the lock (keep it well under the process-group timeout);
    ``lock_kind``: ``FLOCK`` or ``DIRECTORY`` instead of deciding from the file system (tests)."""

    def wrapper(config, hf_model_name, pretrained_path, pt_checkpoint_exists, *args, **kwargs):
        if (config.get("pretrained_checkpoint") or {}).get("format", "hf") != "hf":
            # a user's Megatron checkpoint (policy.pretrained_checkpoint): NeMo-RL converts nothing,
            # and pretrained_path is that checkpoint, not the conversion cache: never move it
            return handle_model_import(config, hf_model_name, pretrained_path, pt_checkpoint_exists, *args, **kwargs)
        rank0 = is_rank0()
        lock = pretrained_path.rstrip("/") + ".lock"
        with wait_for_lock(lock, rank0=rank0, broadcast=broadcast, poll_s=poll_s, log=log, kind=lock_kind):
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
