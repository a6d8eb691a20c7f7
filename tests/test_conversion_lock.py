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
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

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
        handle_model_import, is_rank0=lambda: True, broadcast=lambda v: v, barrier=lambda: None)
    fn({}, "Qwen/Qwen3-30B-A3B-Base", path, exists)
""")


def _two_jobs(tmp_path: Path, mode: str) -> list[str]:
    path, log, go = tmp_path / mode / "hf" / "nemo_rl" / "Qwen" / "Qwen3-30B-A3B-Base", tmp_path / f"{mode}.log", \
        tmp_path / f"{mode}.go"
    procs = [subprocess.Popen([sys.executable, "-c", JOB, str(path), str(log), str(go), mode]) for _ in range(2)]
    while not all((tmp_path / f"{go.name}.{p.pid}").exists() for p in procs):   # both jobs past validate_model_paths
        assert all(p.poll() is None for p in procs)
        time.sleep(0.01)
    go.touch()
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    return sorted(line.split()[0] for line in log.read_text().splitlines())


def test_side_by_side_jobs_convert_once_with_the_lock(tmp_path):
    assert _two_jobs(tmp_path, "locked") == ["convert", "skip"]


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
    r = subprocess.run([sys.executable, "-c", "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR); "
                        "fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)", str(tmp_path / "m.lock")], timeout=60)
    assert r.returncode == 0
    with file_lock(str(tmp_path / "m.lock")):
        pass


RANK = textwrap.dedent("""
    import datetime, os, sys, time
    import torch.distributed as dist
    from nemo_granular.nemo_rl.conversion_lock import locked_model_import
    path, log, store, rank = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
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
                             barrier=lambda: dist.barrier(group=group), poll_s=0.5)
    fn({}, "Qwen/Qwen3-30B-A3B-Base", path, False)
    dist.destroy_process_group()
""")

OTHER_JOB = textwrap.dedent("""
    import fcntl, os, sys, time
    path, log, held = sys.argv[1:4]
    fd = os.open(path + ".lock", os.O_CREAT | os.O_RDWR, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    open(held, "w").close()
    while not all(os.path.exists(f"{log}.ready{r}") for r in (0, 1)): time.sleep(0.05)
    time.sleep(8)                                         # converting: longer than the ranks' 3 s timeout
    it = os.path.join(path, "iter_0000000")
    os.makedirs(it)
    for name in ("metadata.json", "run_config.yaml"): open(os.path.join(it, name), "w").close()
    fcntl.flock(fd, fcntl.LOCK_UN)
""")


@pytest.mark.dist
def test_a_job_waiting_for_another_jobs_conversion_outlives_the_process_group_timeout(tmp_path):
    """Job B (two ranks, gloo, 3 s collective timeout) starts while job A holds the lock for 8 s and
    converts: B's ranks wait in rounds of short broadcasts, then find A's checkpoint and skip.
    Blocking rank 0 on the lock while rank 1 sits in one broadcast ends B with a timeout."""
    path, log, held = tmp_path / "nemo_rl" / "Qwen" / "Qwen3-30B-A3B-Base", tmp_path / "b.log", tmp_path / "held"
    path.parent.mkdir(parents=True)
    other = subprocess.Popen([sys.executable, "-c", OTHER_JOB, str(path), str(log), str(held)])
    while not held.exists():
        assert other.poll() is None
        time.sleep(0.05)
    ranks = [subprocess.Popen([sys.executable, "-c", RANK, str(path), str(log), str(tmp_path / "store"), str(r)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=240)[0] for p in ranks]
    assert other.wait(timeout=60) == 0
    assert [p.returncode for p in ranks] == [0, 0], "\n".join(outs)
    assert sorted(log.read_text().splitlines()) == ["skip 0", "skip 1"]
    assert "held by another job" in outs[0]


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

    fn = locked_model_import(handle_model_import, is_rank0=lambda: True, broadcast=lambda v: v,
                             barrier=lambda: None, log=lines.append)
    fn({}, "Qwen/Qwen3-30B-A3B-Base", str(path), True)    # NeMo-RL: iter_0000000 exists
    assert calls == [False]
    (aside,) = path.parent.glob("Qwen3-30B-A3B-Base.partial-*")
    assert (aside / "iter_0000000" / "__0_0.distcp").read_bytes() == b"half"
    moved = [line for line in lines if "moved to" in line]
    assert len(moved) == 1 and str(aside) in moved[0]
    assert [line for line in lines if line not in moved][0].startswith("conversion lock: ")   # which lock, and why
    fn({}, "Qwen/Qwen3-30B-A3B-Base", str(path), True)    # the next job: converted, skips
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
    fn = locked_model_import(lambda c, h, p, e: calls.append((p, e)), is_rank0=lambda: True,
                             broadcast=lambda v: v, barrier=lambda: None)
    for fmt in ("megatron_bridge", "megatron_lm"):
        fn({"pretrained_checkpoint": {"format": fmt, "path": str(path)}}, "m", str(path), True)
    assert calls == [(str(path), True)] * 2
    assert (path / "run_config.yaml").exists()
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == ["iter_0005000"]   # no .partial-*, no .lock
