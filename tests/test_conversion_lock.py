"""``nemo_granular.nemo_rl.conversion_lock``: two jobs started side by side on a fresh cache
convert the HF model into ``$HF_HOME/nemo_rl/<model>`` once, not twice into the same folder.

Two real processes, each a "job" with one rank; NeMo-RL's ``handle_model_import`` is replaced by
a stand-in with its contract (convert when told the checkpoint is not there; the conversion is
slow, creates ``iter_0000000`` first and its completion files last). Both compute
``pt_checkpoint_exists`` before either converts, as NeMo-RL's ``validate_model_paths`` does at worker
start. The collective version (every rank of a job, ``torch.distributed``) runs in the Megatron
worker tests (tests/test_megatron_worker.py); here a two-rank gloo world with a short timeout shows
that a job waiting for another's conversion outlives the process-group timeout, and a folder left
by a conversion killed half way is not taken as converted.

Which lock: ``flock`` only where it works across nodes. The mount of the lock path decides (parsed
from a given ``/proc/mounts`` text: Lustre without ``-o flock`` and NFS with node-local locks get the
directory lock), and an ``flock`` that fails as unsupported falls back to it. The directory lock is
tested across real processes (the holders' own timestamps show one holder at a time), for stale
takeover (a dead job's lock with an old heartbeat is taken over, a live one's is not), and under
the side-by-side jobs above with the kind forced.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from nemo_granular.nemo_rl import conversion_lock as cl

JOB = textwrap.dedent("""
    import os, sys, time
    from nemo_granular.nemo_rl.conversion_lock import locked_model_import
    path, log, go, mode = sys.argv[1:5]

    def handle_model_import(config, hf_model_name, pretrained_path, pt_checkpoint_exists):
        if pt_checkpoint_exists:
            with open(log, "a") as f: f.write(f"skip {os.getpid()}\\n")
            return
        with open(log, "a") as f: f.write(f"convert {os.getpid()}\\n")
        it = os.path.join(pretrained_path, "iter_0000000")
        os.makedirs(it, exist_ok=True)                    # Megatron: the folder first
        time.sleep(1.5)                                   # a conversion takes a while
        for name in ("metadata.json", "run_config.yaml"): # ... and its completion files last
            open(os.path.join(it, name), "w").close()

    exists = os.path.exists(os.path.join(path, "iter_0000000"))   # NeMo-RL: validate_model_paths, at worker start
    open(f"{go}.{os.getpid()}", "w").close()
    while not os.path.exists(go): time.sleep(0.01)        # both jobs past that point
    fn = handle_model_import if mode == "plain" else locked_model_import(
        handle_model_import, is_rank0=lambda: True, broadcast=lambda v: v, barrier=lambda: None,
        lock_kind={"locked": None, "locked-directory": "directory"}[mode])
    fn({}, "Qwen/Qwen3-30B-A3B-Base", path, exists)
""")


def _two_jobs(tmp_path: Path, mode: str) -> list[str]:
    path, log, go = (
        tmp_path / mode / "hf" / "nemo_rl" / "Qwen" / "Qwen3-30B-A3B-Base",
        tmp_path / f"{mode}.log",
        tmp_path / f"{mode}.go",
    )
    procs = [subprocess.Popen([sys.executable, "-c", JOB, str(path), str(log), str(go), mode]) for _ in range(2)]
    while not all((tmp_path / f"{go.name}.{p.pid}").exists() for p in procs):  # both jobs past validate_model_paths
        assert all(p.poll() is None for p in procs)
        time.sleep(0.01)
    go.touch()
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    return sorted(line.split()[0] for line in log.read_text().splitlines())


@pytest.mark.parametrize("mode", ["locked", "locked-directory"])
def test_side_by_side_jobs_convert_once_with_the_lock(tmp_path, mode):
    """With the lock the file system gets here (flock), and with the directory lock forced."""
    assert _two_jobs(tmp_path, mode) == ["convert", "skip"]
    assert not list((tmp_path / mode / "hf" / "nemo_rl" / "Qwen").glob("*.lock.d*"))  # released: nothing left


def test_without_the_lock_both_convert_into_the_same_folder(tmp_path):
    """The race the lock removes (NeMo-RL's import as it is)."""
    assert _two_jobs(tmp_path, "plain") == ["convert", "convert"]


def test_the_lock_is_released_when_the_import_fails(tmp_path):
    from nemo_granular.nemo_rl.conversion_lock import file_lock, locked_model_import

    def broken(*_a, **_k):
        raise RuntimeError("conversion failed")

    fn = locked_model_import(broken, is_rank0=lambda: True, broadcast=lambda v: v, barrier=lambda: None)
    with pytest.raises(RuntimeError, match="conversion failed"):
        fn({}, "m", str(tmp_path / "m"), False)
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR); "
            "fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)",
            str(tmp_path / "m.lock"),
        ],
        timeout=60,
    )
    assert r.returncode == 0
    with file_lock(str(tmp_path / "m.lock")):
        pass


RANK = textwrap.dedent("""
    import datetime, os, sys, time
    import torch.distributed as dist
    from nemo_granular.nemo_rl.conversion_lock import locked_model_import
    path, log, store, rank, kind = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
    # start-up under a generous timeout (two cold torch imports on a busy machine), then the
    # group the lock's collectives use: a timeout far below the other job's conversion
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    dist.barrier()
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=3), backend="gloo")
    open(f"{log}.ready{rank}", "w").close()

    def broadcast(value):
        box = [value]
        dist.broadcast_object_list(box, src=0, group=group)
        return bool(box[0])

    def handle_model_import(config, hf_model_name, pretrained_path, pt_checkpoint_exists):
        with open(log, "a") as f: f.write(f"{'skip' if pt_checkpoint_exists else 'convert'} {rank}\\n")

    fn = locked_model_import(handle_model_import, is_rank0=lambda: rank == 0, broadcast=broadcast,
                             barrier=lambda: dist.barrier(group=group), poll_s=0.5, lock_kind=kind)
    fn({}, "Qwen/Qwen3-30B-A3B-Base", path, False)
    dist.destroy_process_group()
""")

# the module under test loaded from its file (sys.argv[-1]) without the package's heavier __init__ (torch):
# the lock subprocesses below start in well under a second on a busy machine
LOAD_MODULE = textwrap.dedent("""
    import importlib.util, sys
    _spec = importlib.util.spec_from_file_location("conversion_lock_under_test", sys.argv[-1])
    cl = importlib.util.module_from_spec(_spec)
    sys.modules[_spec.name] = cl
    _spec.loader.exec_module(cl)
""")

OTHER_JOB = LOAD_MODULE + textwrap.dedent("""
    import fcntl, os, sys, time
    path, log, held, kind = sys.argv[1:5]
    if kind == "flock":
        fd = os.open(path + ".lock", os.O_CREAT | os.O_RDWR, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
    else:                                                 # the lock directory ConversionLock uses for <folder>.lock
        lock = cl.DirectoryLock(path + ".lock.d", heartbeat_s=1.0, stale_s=600)
        assert lock.try_acquire()
    open(held, "w").close()
    while not all(os.path.exists(f"{log}.ready{r}") for r in (0, 1)): time.sleep(0.05)
    time.sleep(8)                                         # converting: longer than the ranks' 3 s timeout
    it = os.path.join(path, "iter_0000000")
    os.makedirs(it)
    for name in ("metadata.json", "run_config.yaml"): open(os.path.join(it, name), "w").close()
    fcntl.flock(fd, fcntl.LOCK_UN) if kind == "flock" else lock.release()
""")


@pytest.mark.dist
@pytest.mark.parametrize("kind", ["flock", "directory"])
def test_a_job_waiting_for_another_jobs_conversion_outlives_the_process_group_timeout(tmp_path, kind):
    """Job B (two ranks, gloo, 3 s collective timeout) starts while job A holds the lock for 8 s and
    converts: B's ranks wait in rounds of short broadcasts, then find A's checkpoint and skip.
    Blocking rank 0 on the lock while rank 1 sits in one broadcast ends B with a timeout. Both
    kinds of lock: the directory lock keeps the same rounds."""
    path, log, held = tmp_path / "nemo_rl" / "Qwen" / "Qwen3-30B-A3B-Base", tmp_path / "b.log", tmp_path / "held"
    path.parent.mkdir(parents=True)
    other = subprocess.Popen([sys.executable, "-c", OTHER_JOB, str(path), str(log), str(held), kind, cl.__file__])
    while not held.exists():
        assert other.poll() is None
        time.sleep(0.05)
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, str(path), str(log), str(tmp_path / "store"), str(r), kind],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in (0, 1)
    ]
    outs = [p.communicate(timeout=240)[0] for p in ranks]
    assert other.wait(timeout=60) == 0
    assert [p.returncode for p in ranks] == [0, 0], "\n".join(outs)
    assert sorted(log.read_text().splitlines()) == ["skip 0", "skip 1"]
    assert "held by another job" in outs[0]
    if kind == "directory":
        assert f"Qwen3-30B-A3B-Base.lock.d: held by another job (host {socket.gethostname()} pid {other.pid}" in outs[0]


def test_a_conversion_killed_half_way_is_moved_aside_and_converted_again(tmp_path):
    """``iter_0000000`` with shards but without the files a conversion writes last (a job killed
    mid-save): NeMo-RL's rule calls it converted and every later job would skip the import and fail
    to load; here it is renamed aside (kept) and the import runs."""
    from nemo_granular.nemo_rl.conversion_lock import locked_model_import

    path = tmp_path / "nemo_rl" / "Qwen" / "Qwen3-30B-A3B-Base"
    (path / "iter_0000000").mkdir(parents=True)
    (path / "iter_0000000" / "__0_0.distcp").write_bytes(b"half")
    calls, lines = [], []

    def handle_model_import(config, hf_model_name, pretrained_path, pt_checkpoint_exists):
        calls.append(pt_checkpoint_exists)
        if not pt_checkpoint_exists:
            it = Path(pretrained_path) / "iter_0000000"
            it.mkdir(parents=True)
            for name in ("metadata.json", "run_config.yaml"):
                (it / name).touch()

    fn = locked_model_import(
        handle_model_import, is_rank0=lambda: True, broadcast=lambda v: v, barrier=lambda: None, log=lines.append
    )
    fn({}, "Qwen/Qwen3-30B-A3B-Base", str(path), True)  # NeMo-RL: iter_0000000 exists
    assert calls == [False]
    (aside,) = path.parent.glob("Qwen3-30B-A3B-Base.partial-*")
    assert (aside / "iter_0000000" / "__0_0.distcp").read_bytes() == b"half"
    moved = [line for line in lines if "moved to" in line]
    assert len(moved) == 1 and str(aside) in moved[0]
    assert [line for line in lines if line not in moved][0].startswith("conversion lock: ")  # which lock, and why
    fn({}, "Qwen/Qwen3-30B-A3B-Base", str(path), True)  # the next job: converted, skips
    assert calls == [False, True]


def test_a_users_megatron_checkpoint_is_passed_through_untouched(tmp_path):
    """``policy.pretrained_checkpoint`` (format megatron_bridge / megatron_lm): ``pretrained_path`` is
    the user's own checkpoint, which NeMo-RL does not convert: it is never moved aside, whatever
    files it holds, and no lock file is made beside it (the earlier code made one there)."""
    from nemo_granular.nemo_rl.conversion_lock import locked_model_import

    path = tmp_path / "mine" / "iter_0005000"
    path.mkdir(parents=True)
    (path / "run_config.yaml").touch()
    calls = []
    fn = locked_model_import(
        lambda c, h, p, e: calls.append((p, e)), is_rank0=lambda: True, broadcast=lambda v: v, barrier=lambda: None
    )
    for fmt in ("megatron_bridge", "megatron_lm"):
        fn({"pretrained_checkpoint": {"format": fmt, "path": str(path)}}, "m", str(path), True)
    assert calls == [(str(path), True)] * 2
    assert (path / "run_config.yaml").exists()
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == ["iter_0005000"]  # no .partial-*, no .lock


# ---------------------------------------------------------------- which lock: the mount of the lock path

MOUNTS = textwrap.dedent(r"""
    rootfs / rootfs rw 0 0
    /dev/sda1 / ext4 rw,relatime 0 0
    10.0.0.1@o2ib:/fs1 /lustre lustre rw,flock,lazystatfs 0 0
    10.0.0.1@o2ib:/fs2 /lustre/scratch lustre rw,localflock,lazystatfs 0 0
    10.0.0.1@o2ib:/fs3 /lnoflock lustre rw,noflock,lazystatfs 0 0
    10.0.0.1@o2ib:/fs4 /lplain lustre rw,lazystatfs 0 0
    10.0.0.1@o2ib:/fs5 /with\040space lustre rw,localflock 0 0
    10.0.0.1@o2ib:/fs6 /over lustre rw,flock 0 0
    10.0.0.1@o2ib:/fs7 /over lustre rw,localflock 0 0
    server:/export /nfs nfs4 rw,vers=4.2,local_lock=none,addr=10.0.0.2 0 0
    server:/export /nfsnolock nfs rw,vers=3,nolock,local_lock=all,addr=10.0.0.2 0 0
    /dev/sdb /xfs xfs rw,relatime 0 0
    gpfs1 /gpfs gpfs rw,relatime 0 0
""")


@pytest.mark.parametrize(
    "lock_path, kind",
    [
        ("/lustre/hf/nemo_rl/m.lock", cl.FLOCK),  # lustre -o flock: works across nodes
        ("/lustre/scratch/hf/m.lock", cl.DIRECTORY),  # localflock; /lustre/scratch beats /lustre
        ("/lustre/scratchy/m.lock", cl.FLOCK),  # not under /lustre/scratch: /lustre's
        ("/lnoflock/hf/m.lock", cl.DIRECTORY),  # noflock
        ("/lplain/hf/m.lock", cl.DIRECTORY),  # neither option
        ("/with space/hf/m.lock", cl.DIRECTORY),  # \040 in /proc/mounts is a space
        ("/over/m.lock", cl.DIRECTORY),  # mounted twice at one point: the later hides the first
        ("/nfs/hf/m.lock", cl.FLOCK),  # NFSv4 with its lock manager
        ("/nfsnolock/hf/m.lock", cl.DIRECTORY),  # NFS nolock: flock stays on the node
        ("/xfs/m.lock", cl.FLOCK),
        ("/gpfs/hf/m.lock", cl.FLOCK),
        ("/home/user/m.lock", cl.FLOCK),  # ext4 at /
        ("/lplainer/m.lock", cl.FLOCK),  # "/lplain" is a prefix of the string, not a parent
    ],
)
def test_the_mount_of_the_lock_path_picks_the_lock(lock_path, kind):
    trusted, _why = cl.flock_verdict(cl.mount_for_path(lock_path, MOUNTS))
    assert (cl.FLOCK if trusted else cl.DIRECTORY) == kind


def test_the_reasons_name_the_file_system_and_its_mount_option():
    def why(path):
        return cl.flock_verdict(cl.mount_for_path(path, MOUNTS))[1]

    assert why("/lustre/scratch/x") == "is on lustre (/lustre/scratch) mounted localflock: flock is node-local there"
    assert why("/lnoflock/x") == "is on lustre (/lnoflock) mounted noflock: flock is not supported there"
    assert why("/lplain/x") == "is on lustre (/lplain) mounted without flock: flock is not supported there"
    assert why("/nfsnolock/x") == "is on nfs (/nfsnolock) mounted nolock: flock is node-local there"
    assert why("/lustre/x") == "is on lustre (/lustre) mounted flock: flock works across nodes there"
    assert cl.mount_for_path("/x", "") is None and cl.flock_verdict(None)[0]  # no /proc/mounts: flock


def test_the_lock_path_is_resolved_through_symlinks_and_the_choice_is_logged(tmp_path):
    """``/scratch`` that is a link into Lustre: the real path's mount decides. The one line names the
    lock, the file system, its option, and the lock used."""
    real = tmp_path.resolve() / "lustre"
    (real / "hf").mkdir(parents=True)
    (tmp_path / "scratch").symlink_to(real)
    mounts = f"/dev/vda / ext4 rw 0 0\n10.0.0.1@o2ib:/fs {real} lustre rw,localflock 0 0\n"
    lock_path = str(tmp_path / "scratch" / "hf" / "m.lock")
    assert cl.lock_kind_for(lock_path, mounts)[0] == cl.DIRECTORY
    lines = []
    lock = cl.ConversionLock(lock_path, mounts_text=mounts, log=lines.append)
    assert lock.kind == cl.DIRECTORY and lock.lock_path == lock_path + ".d"
    assert lines == [
        f"conversion lock: {lock_path} is on lustre ({real}) mounted localflock: flock is node-local "
        f"there; using a lock directory with a heartbeat ({lock_path}.d)"
    ]
    assert lock.try_acquire() and (real / "hf" / "m.lock.d" / "owner.json").is_file()
    lock.release()
    assert sorted(p.name for p in (real / "hf").iterdir()) == []  # no m.lock file, no lock directory left


@pytest.mark.parametrize("err", [errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOLCK], ids=errno.errorcode.get)
def test_an_flock_that_is_not_supported_falls_back_to_the_directory_lock(tmp_path, monkeypatch, err):
    """Lustre mounted noflock (ENOSYS, EINVAL or EOPNOTSUPP by version), NFS without a lock manager
    (ENOLCK): the file system looked fine for flock, the call says otherwise."""

    def no_flock(fd, op):
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(fcntl, "flock", no_flock)
    lines = []
    lock_path = tmp_path / "m.lock"
    with cl.wait_for_lock(str(lock_path), rank0=True, broadcast=lambda v: v, log=lines.append, kind=cl.FLOCK):
        owner = json.loads((tmp_path / "m.lock.d" / "owner.json").read_text())
        assert owner["pid"] == os.getpid()
    assert not (tmp_path / "m.lock.d").exists()
    assert f"conversion lock: flock on {lock_path} failed ({errno.errorcode[err]}: " in lines[1]
    assert lines[1].endswith(f"using a lock directory with a heartbeat ({lock_path}.d)")


def test_an_flock_error_that_is_not_about_support_is_raised(tmp_path, monkeypatch):
    def broken(fd, op):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(fcntl, "flock", broken)
    lock = cl.ConversionLock(str(tmp_path / "m.lock"), kind=cl.FLOCK, log=lambda _: None)
    with pytest.raises(OSError, match="Input/output error"):
        lock.try_acquire()
    assert not (tmp_path / "m.lock.d").exists()


# ---------------------------------------------------------------- the directory lock

HOLDER = LOAD_MODULE + textwrap.dedent("""
    import os, sys, time
    path, out, go, rounds = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    while not os.path.exists(go): time.sleep(0.005)
    for _ in range(rounds):
        with cl.file_lock(path, kind="directory", poll_s=0.005, log=lambda line: None):
            start = time.monotonic()                      # this holder's own clock readings
            time.sleep(0.05)
            end = time.monotonic()
            with open(out, "a") as f: f.write(f"{start} {end}\\n")
""")


def test_the_directory_lock_has_one_holder_at_a_time_across_processes(tmp_path):
    """Three processes take and release the directory lock five times each; each holder writes the
    monotonic clock (system-wide on Linux) when it has the lock and just before it lets go. No two
    of these intervals overlap."""
    go, outs = tmp_path / "go", [tmp_path / f"holder{i}.txt" for i in range(3)]
    procs = [
        subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path / "m.lock"), str(out), str(go), "5", cl.__file__])
        for out in outs
    ]
    go.touch()
    assert [p.wait(timeout=120) for p in procs] == [0, 0, 0]
    held = sorted(tuple(map(float, line.split())) for out in outs for line in out.read_text().splitlines())
    assert len(held) == 15
    overlaps = [(a, b) for a, b in zip(held, held[1:]) if b[0] < a[1]]
    assert not overlaps, overlaps
    assert sorted(p.name for p in tmp_path.iterdir()) == ["go", *(o.name for o in outs)]  # nothing left behind


OWNER = LOAD_MODULE + textwrap.dedent("""
    import os, sys, time
    path, held, release, heartbeat_s = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
    lock = cl.DirectoryLock(path, heartbeat_s=heartbeat_s, stale_s=600)
    assert lock.try_acquire()
    open(held, "w").close()
    while not os.path.exists(release): time.sleep(0.02)
    lock.release()
""")


def _start_owner(tmp_path: Path, heartbeat_s: float) -> subprocess.Popen:
    """A job (Slurm job 4242) that holds ``tmp_path/m.lock.d`` until ``tmp_path/release`` exists."""
    owner = subprocess.Popen(
        [
            sys.executable,
            "-c",
            OWNER,
            str(tmp_path / "m.lock.d"),
            str(tmp_path / "held"),
            str(tmp_path / "release"),
            str(heartbeat_s),
            cl.__file__,
        ],
        env={**os.environ, "SLURM_JOB_ID": "4242"},
    )
    while not (tmp_path / "held").exists():
        assert owner.poll() is None
        time.sleep(0.02)
    return owner


def test_a_dead_jobs_lock_with_an_old_heartbeat_is_taken_over(tmp_path, monkeypatch):
    """The owner is killed while it holds the lock; its record's heartbeat is then set 601 s back (as
    if ten minutes had passed). A waiter with the default threshold takes the lock over with one line
    naming the dead owner, and keeps its directory aside."""
    monkeypatch.delenv(cl.STALE_SECONDS_ENV, raising=False)
    owner = _start_owner(tmp_path, heartbeat_s=30)
    owner.send_signal(signal.SIGKILL)
    owner.wait(timeout=60)
    record_path = tmp_path / "m.lock.d" / "owner.json"
    record = json.loads(record_path.read_text())
    assert (record["pid"], record["slurm_job_id"]) == (owner.pid, "4242")
    lines = []
    waiter = cl.DirectoryLock(str(tmp_path / "m.lock.d"), log=lines.append)
    assert not waiter.try_acquire() and lines == []  # its heartbeat is fresh: not taken over
    record_path.write_text(json.dumps({**record, "heartbeat": time.time() - 601}))
    assert waiter.try_acquire()
    assert len(lines) == 1 and lines[0].startswith(
        f"conversion lock: {tmp_path}/m.lock.d: taking over the lock of host {socket.gethostname()} pid {owner.pid} "
        f"(Slurm job 4242), whose last heartbeat is 601 s old (over 600 s, {cl.STALE_SECONDS_ENV})"
    )
    aside = tmp_path / f"m.lock.d.stale-{record['token']}"
    assert json.loads((aside / "owner.json").read_text())["pid"] == owner.pid and str(aside) in lines[0]
    assert json.loads(record_path.read_text())["pid"] == os.getpid()
    waiter.release()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["held", aside.name]


def test_a_live_jobs_lock_is_not_taken_over(tmp_path):
    """The owner holds the lock for 3 s and beats every 0.2 s; a waiter whose threshold is 1 s tries
    all that time and never gets it (without the heartbeat it would after 1 s), then gets it once the
    owner releases."""
    owner = _start_owner(tmp_path, heartbeat_s=0.2)
    lines = []
    waiter = cl.DirectoryLock(str(tmp_path / "m.lock.d"), stale_s=1.0, log=lines.append)
    try:
        end = time.monotonic() + 3
        while time.monotonic() < end:
            assert not waiter.try_acquire(), lines
            time.sleep(0.1)
        record = json.loads((tmp_path / "m.lock.d" / "owner.json").read_text())
        assert record["pid"] == owner.pid and time.time() - record["heartbeat"] < 1.0
    finally:
        (tmp_path / "release").touch()
    assert owner.wait(timeout=60) == 0
    assert waiter.try_acquire() and lines == []
    waiter.release()
    assert not (tmp_path / "m.lock.d").exists()


def test_release_leaves_the_lock_of_whoever_took_it_over(tmp_path):
    """A holder that stalled past the threshold (its heartbeat stopped) is taken over; when it
    resumes and releases, the new holder's lock stays, and the one line says so."""
    first_lines, path = [], str(tmp_path / "m.lock.d")
    first = cl.DirectoryLock(path, heartbeat_s=3600, stale_s=600, log=first_lines.append)
    assert first.try_acquire()
    record_path = tmp_path / "m.lock.d" / "owner.json"
    record_path.write_text(json.dumps({**json.loads(record_path.read_text()), "heartbeat": time.time() - 700}))
    second = cl.DirectoryLock(path, stale_s=600, log=[].append)
    assert second.try_acquire()
    second_token = json.loads(record_path.read_text())["token"]
    first.release()
    assert json.loads(record_path.read_text())["token"] == second_token
    assert len(first_lines) == 1 and first_lines[0].endswith("(this job's lock was taken over): left as it is")
    second.release()
    assert not (tmp_path / "m.lock.d").exists()


def test_the_stale_threshold_comes_from_its_variable():
    assert cl.stale_seconds({}) == cl.DEFAULT_STALE_SECONDS == 600
    assert cl.stale_seconds({cl.STALE_SECONDS_ENV: "1800"}) == 1800
    for bad in ("ten minutes", "30", "-1", "nan"):
        with pytest.raises(ValueError, match=cl.STALE_SECONDS_ENV):
            cl.stale_seconds({cl.STALE_SECONDS_ENV: bad})
