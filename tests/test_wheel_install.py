"""A non-editable install works: build the wheel, install it into a clean venv, run ``compare --smoke``.

The venv is created without the repository on ``sys.path`` (commands run from an empty
directory, no PYTHONPATH) and sees the heavy dependencies (torch, transformers, ...) through a
``.pth`` line naming this environment's site-packages, so nothing is downloaded. A ``.pth`` line
only appends a directory: the editable install's finder in that directory is not activated, so
``nemo_granular`` can only come from the wheel.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "warmstart.max_steps=10",
    "rl.steps=2",
    "model.hidden_size=32",
    "model.num_layers=1",
    "model.intermediate_size=64",
    "task.heldout_size=8",
]


def _run(cmd, cwd, env, timeout=900):
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.mark.slow
def test_wheel_in_a_clean_venv_runs_compare_smoke(tmp_path):
    # 1. the wheel, built from a copy of what a source distribution holds (the repo stays untouched)
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(
        ROOT / "nemo_granular",
        src / "nemo_granular",
        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"),
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(PYTHONNOUSERSITE="1", OMP_NUM_THREADS="1")
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--disable-pip-version-check",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(src),
        ],
        tmp_path,
        env,
    )
    (wheel,) = (tmp_path / "dist").glob("nemo_granular-*.whl")

    # 2. a clean venv with only the wheel installed; dependencies visible through a .pth line
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp_path, env)
    py = venv / "bin" / "python"
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(py),
            "install",
            "--no-deps",
            "--no-index",
            "--disable-pip-version-check",
            "-q",
            str(wheel),
        ],
        tmp_path,
        env,
    )
    purelib = Path(
        _run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp_path, env).stdout.strip()
    )
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (purelib / "zz_nemo_granular_test_deps.pth").write_text("".join(d + "\n" for d in sorted(deps)))

    cwd = tmp_path / "cwd"
    cwd.mkdir()
    where = _run(
        [
            str(py),
            "-c",
            "import sys, nemo_granular; print(nemo_granular.__file__); "
            f"print(any(p.startswith({str(ROOT)!r} + '/nemo_granular') or p == {str(ROOT)!r} "
            "for p in sys.path))",
        ],
        cwd,
        env,
    ).stdout.split()
    assert where[0].startswith(str(purelib)) and where[1] == "False", where
    exe = venv / "bin" / "nemo-granular"
    assert _run([str(exe), "--version"], cwd, env).stdout.strip().startswith("nemo-granular ")

    # 3. the packaged configs are found: a comparison end to end from the installed wheel
    res = _run(
        [str(exe), "compare", "--smoke", "--seeds", "1", "--algorithms", "grpo", "--out", "cmp", *TINY], cwd, env
    )
    assert "[grpo seed0] done: grpo step 2/2" in res.stderr, res.stderr[-3000:]
    report = (cwd / "cmp" / "report.md").read_text()
    assert "warm-start cache key seed0-" in report and "| grpo |" in report
    # and a single run by packaged config name
    res = _run(
        [str(exe), "train", "--config", "sspo", "warmstart.enabled=false", "rl.steps=1", *TINY[2:], "output_dir=one"],
        cwd,
        env,
    )
    assert res.stdout.startswith("done: sspo step 1/1")  # the run's summary: stdout (progress: stderr)
