"""``nemo_granular.nemo_rl.conversion_lock``: two jobs started side by side on a fresh cache
convert the HF model into ``$HF_HOME/nemo_rl/<model>`` once, not twice into the same folder.

Two real processes, each a "job" with one rank; NeMo-RL's ``handle_model_import`` is replaced by
a stand-in with its contract (convert when told the checkpoint is not there; the conversion is
slow and writes ``iter_0000000``). Both compute ``pt_checkpoint_exists`` before either converts,
as NeMo-RL's ``validate_model_paths`` does at worker start. The collective version (every rank of
a job, ``torch.distributed``) runs in the Megatron worker tests (tests/test_megatron_worker.py).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

JOB = textwrap.dedent("""
    import os, sys, time
    from nemo_granular.nemo_rl.conversion_lock import converted, locked_model_import
    path, log, go, mode = sys.argv[1:5]

    def handle_model_import(config, hf_model_name, pretrained_path, pt_checkpoint_exists):
        if pt_checkpoint_exists:
            with open(log, "a") as f: f.write(f"skip {os.getpid()}\\n")
            return
        with open(log, "a") as f: f.write(f"convert {os.getpid()}\\n")
        time.sleep(1.5)                                   # a conversion takes a while
        os.makedirs(os.path.join(pretrained_path, "iter_0000000"), exist_ok=True)

    exists = converted(path)                              # NeMo-RL: validate_model_paths, at worker start
    while not os.path.exists(go): time.sleep(0.01)        # both jobs past that point
    fn = handle_model_import if mode == "plain" else locked_model_import(
        handle_model_import, is_rank0=lambda: True, broadcast=lambda v: v, barrier=lambda: None)
    fn({}, "Qwen/Qwen3-30B-A3B-Base", path, exists)
""")


def _two_jobs(tmp_path: Path, mode: str) -> list[str]:
    path, log, go = tmp_path / mode / "hf" / "nemo_rl" / "Qwen" / "Qwen3-30B-A3B-Base", tmp_path / f"{mode}.log", \
        tmp_path / f"{mode}.go"
    procs = [subprocess.Popen([sys.executable, "-c", JOB, str(path), str(log), str(go), mode]) for _ in range(2)]
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
