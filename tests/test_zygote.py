"""``compare``'s runs forked from a zygote behave as ``python -m nemo_granular ARGV`` started afresh.

Each case runs the same command both ways (a new interpreter with ``subprocess``, and a fork of one
zygote) and compares what a caller sees: the exit status, the merged stdout/stderr, the session, the
working directory and the environment the command ran with. ``compare``'s own behaviour with the
zygote (Ctrl-C, SIGTERM, resume) is ``tests/test_compare.py``'s.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_granular.zygote import Zygote


@pytest.fixture(scope="module")
def zygote():
    z = Zygote(dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"))
    yield z
    z.close()


def _fresh(argv, env, cwd):
    done = subprocess.run(
        [sys.executable, "-m", "nemo_granular", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=cwd,
        start_new_session=True,
    )
    return done.returncode, done.stdout


def _forked(zygote, argv, env, cwd):
    run = zygote.start(argv, env=env, cwd=str(cwd))
    text = run.stdout.read()
    return run.wait(), text


def _cases(tmp: Path):
    (tmp / "bad.yaml").write_text("rl: [\n")  # found only from this directory: a YAML error, not "not found"
    base = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    debug = dict(base, NEMO_GRANULAR_DEBUG="1")  # the CLI re-raises: an uncaught exception, exit 1, a traceback
    return [
        (["--version"], base),
        (["no-such-command"], base),
        (["train", "--config", "missing.yaml"], base),
        (["train", "--config", "bad.yaml"], base),
        (["train", "--config", "bad.yaml"], debug),
        (["train"], base),
    ]


def test_a_forked_command_answers_as_a_fresh_interpreter(zygote, tmp_path):
    for argv, env in _cases(tmp_path):
        rc, out = _fresh(argv, env, tmp_path)
        frc, fout = _forked(zygote, argv, env, tmp_path)
        assert frc == rc, (argv, rc, frc, out, fout)
        if "NEMO_GRANULAR_DEBUG" in env:  # a traceback: the frames above main() differ (runpy vs the zygote)
            assert rc == 1 and "Traceback (most recent call last)" in fout
            assert fout.strip().splitlines()[-1] == out.strip().splitlines()[-1], (fout, out)
        else:
            assert fout == out, (argv, out, fout)


def test_a_forked_command_has_its_own_session_and_working_directory(zygote, tmp_path):
    """A run in its own session (a terminal's Ctrl-C reaches ``compare`` only, which forwards it), in the
    directory asked for (a relative ``output_dir`` lands there). The environment: the DEBUG case above."""
    import signal
    import time

    here = tmp_path / "here"
    here.mkdir()
    run = zygote.start(
        [
            "train",
            "--config",
            "grpo",
            "output_dir=rel_out",
            "rl.steps=1000",
            "logger.progress=false",
            "logger.tensorboard=false",
        ],
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        cwd=str(here),
    )
    try:
        deadline = time.monotonic() + 120
        while not (here / "rel_out").is_dir():
            assert run.poll() is None and time.monotonic() < deadline, run.stdout.read()
            time.sleep(0.2)
        # (the zygote reports the pid at the fork; the child makes its session first thing after)
        assert os.getsid(run.pid) == run.pid != os.getsid(0)
    finally:
        run.send_signal(signal.SIGKILL)
        run.stdout.read()
        assert run.wait() == -signal.SIGKILL  # as Popen reports a signal: its negative


def test_output_of_a_run_ends_when_it_ends_while_another_runs(zygote, tmp_path):
    """Two commands at once: each one's output and exit status are its own, reported when it ends (a short
    command answers while a training run is still going on, which then ends normally)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    slow = zygote.start(
        [
            "train",
            "--config",
            "grpo",
            f"output_dir={tmp_path / 'r'}",
            "rl.steps=1",
            "warmstart.max_steps=25",
            "logger.progress=false",
            "logger.tensorboard=false",
        ],
        env=env,
        cwd=str(tmp_path),
    )
    fast = zygote.start(["--version"], env=env, cwd=str(tmp_path))
    assert fast.stdout.read().startswith("nemo-granular ")
    assert fast.wait() == 0 and slow.poll() is None  # answered while the training run still runs
    text = slow.stdout.read()
    assert slow.wait() == 0, text
    assert "done: grpo step 1/1" in text
