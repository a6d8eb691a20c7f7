"""``nemo_granular.preflight.runtime``: the preflight checks the runtime a job will have.

No NeMo-RL needed: the checks read the launch story's environment (given here as a dict) and the
file system. Through a real (local) Slurm cluster and its pyxis, launch.sh's own check of the same
CONTAINER + VENV combination is in tests/test_slurm.py.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from nemo_granular.preflight.runtime import parse_sbatch_time, runtime_findings

CFG = {"checkpointing": {"enabled": True, "checkpoint_must_save_by": "00:03:45:00"}}


def _uv_venv(tmp_path: Path) -> tuple[Path, Path]:
    """A venv on the shared file system whose python links into $HOME, as `uv venv` makes with a
    uv-managed Python (~/.local/share/uv/python/...)."""
    home, shared = tmp_path / "home", tmp_path / "lustre"
    uv_python = home / ".local/share/uv/python/cpython-3.13/bin/python3.13"
    uv_python.parent.mkdir(parents=True)
    uv_python.symlink_to(Path(sys.executable).resolve())
    venv = shared / "NeMo-RL" / ".venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(uv_python)
    return venv, shared


def test_a_host_venv_linking_outside_the_mounts_is_an_error_with_container(tmp_path):
    venv, shared = _uv_venv(tmp_path)
    env = {"CONTAINER": "/images/nemo-rl.sqsh", "MOUNTS": f"{shared}:{shared}", "VENV": str(venv)}
    [f] = runtime_findings({}, env)
    target = Path(sys.executable).resolve()
    assert f.level == "error" and f.message == (
        f"VENV={venv}: its python is a link to {target}, outside MOUNTS ({shared}:{shared}): it does not exist in "
        "the container; with CONTAINER leave VENV unset (the image's environment runs the job; docs/slurm.md)"
    )
    # a VENV not mounted at all
    [f] = runtime_findings({}, {**env, "MOUNTS": f"{tmp_path / 'other'}:/other"})
    assert f.level == "error" and f.message.startswith(f"VENV={venv} is not inside MOUNTS=")
    # no container: the host venv is fine; an interpreter inside the mounts is fine
    assert runtime_findings({}, {"VENV": str(venv)}) == []
    assert runtime_findings({}, {**env, "MOUNTS": f"{shared}:{shared},{target.parents[1]}:{target.parents[1]}"}) == []


def test_without_mounts_only_a_python_under_home_is_certain_to_be_missing(tmp_path):
    """No MOUNTS: site-wide enroot mounts may hold the venv; a python under $HOME is missing anyway."""
    venv, shared = _uv_venv(tmp_path)
    home = tmp_path / "home"
    real = home / ".local/share/uv/python/cpython-3.13/bin/python3.13"
    real.unlink()
    real.write_text("")  # uv's managed Python is a real file under $HOME
    [f] = runtime_findings({}, {"CONTAINER": "/images/x.sqsh", "VENV": str(venv), "HOME": str(home)})
    assert f.level == "error" and f.message.startswith(f"VENV={venv}: its python is a link to {real}, under $HOME")
    assert runtime_findings({}, {"CONTAINER": "/images/x.sqsh", "VENV": str(venv), "HOME": str(shared)}) == []


def test_inside_the_container_the_link_must_resolve(tmp_path):
    venv, _ = _uv_venv(tmp_path)
    (tmp_path / "home" / ".local/share/uv/python/cpython-3.13/bin/python3.13").unlink()  # $HOME not mounted
    [f] = runtime_findings({}, {"NG_CONTAINER": "/images/x.sqsh", "NG_VENV": str(venv), "NG_MOUNTS": ""})
    assert f.level == "error" and "does not exist in the container" in f.message and str(venv) in f.message


def test_worker_venvs_checked_outside_the_container_are_not_where_nemo_rl_looks_inside(tmp_path):
    env = {"CONTAINER": "/images/nemo-rl.sqsh", "MOUNTS": f"{tmp_path}:{tmp_path}"}
    [f] = runtime_findings({}, env, venv_dir=str(tmp_path / "NeMo-RL" / "venvs"))
    assert f.level == "warning" and "the image's NEMO_RL_VENV_DIR" in f.message
    assert f"export NEMO_RL_VENV_DIR={tmp_path / 'NeMo-RL' / 'venvs'}" in f.message
    # set for the job and mounted: launch.sh passes it into the container; not mounted: an error
    assert runtime_findings({}, {**env, "NEMO_RL_VENV_DIR": str(tmp_path / "venvs")}, venv_dir=str(tmp_path)) == []
    [f] = runtime_findings({}, {**env, "NEMO_RL_VENV_DIR": "/scratch/venvs"}, venv_dir="/scratch/venvs")
    assert f.level == "error" and f.message.startswith("NEMO_RL_VENV_DIR=/scratch/venvs is not inside MOUNTS=")
    # no container: nothing to say
    assert runtime_findings({}, {}, venv_dir=str(tmp_path)) == []


@pytest.mark.parametrize(
    "text, seconds",
    [
        ("240", 14400),
        ("4:00:00", 14400),
        ("30:00", 1800),
        ("1-00", 86400),
        ("1-02:03", 93780),
        ("1-02:03:04", 93784),
        ("UNLIMITED", None),
    ],
)
def test_sbatch_time_formats(text, seconds):
    assert parse_sbatch_time(text) == seconds


def test_the_time_budget_against_the_jobs_time_limit():
    # the shipped pair: 3 h 45 min in a 4 h job with the default 15 min reserve: fine
    assert runtime_findings(CFG, {"NG_TIME_LIMIT": "4:00:00"}) == []
    # a 3 h job: NeMo-RL's limit is later than the job's end minus the reserve
    [f] = runtime_findings(CFG, {"NG_TIME_LIMIT": "3:00:00"})
    assert f.level == "warning" and "checkpointing.checkpoint_must_save_by=00:03:45:00 (13500 s" in f.message
    assert "--time=3:00:00 (10800 s) minus NG_SAVE_RESERVE_SECONDS=900" in f.message
    # inside the job: what it has left (launch.sh's NG_JOB_END_TIME)
    [f] = runtime_findings(CFG, {"NG_JOB_END_TIME": str(int(time.time()) + 3600)})
    assert f.level == "warning" and "the time the Slurm job has left" in f.message
    # a job shorter than the reserve is an error
    [f] = runtime_findings({}, {"NG_TIME_LIMIT": "10", "NG_SAVE_RESERVE_SECONDS": "900"})
    assert f.level == "error" and "--time=10 (600 s) is not more than NG_SAVE_RESERVE_SECONDS=900" in f.message
    assert runtime_findings(CFG, {}) == []  # not a Slurm job, no --time: nothing to compare
