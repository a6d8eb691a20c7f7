"""Never lose a run, never report a stale result: signals, resume, overwrite refusal, corrupt checkpoints.

Real signals are sent to real ``nemo-granular train`` processes; the checkpoint-validation and
fallback cases run the trainer in-process on copies of one small finished run.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import tiny_train
from nemo_granular.embedded.checkpoint import CheckpointError, NothingToResume, step_dirs
from nemo_granular.embedded.config import LOCAL_CONFIGS, load_train_config

ROOT = Path(__file__).resolve().parents[1]
TINY = tiny_train("rl.eval_every=2", "logger.log_every=1")


def _env(**extra):
    return dict(os.environ, OMP_NUM_THREADS="1", **extra)


def _train_cmd(*args):
    return [sys.executable, "-m", "nemo_granular", "train", "--config", str(LOCAL_CONFIGS / "grpo.yaml"), *TINY, *args]


def _cli(*args, env=None, timeout=300):
    return subprocess.run(
        _train_cmd(*args), capture_output=True, text=True, env=env or _env(), timeout=timeout, cwd=ROOT
    )


def _steps(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _records(run: Path) -> list[dict]:
    out = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out.append({k: v for k, v in rec.items() if k != "wall_time" and not k.startswith("timing/")})
    return out


def _wait_for(pred, proc, timeout=240, what="condition"):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return
        if proc.poll() is not None:
            raise AssertionError(f"process exited ({proc.returncode}) before {what}: {proc.stderr.read()[-2000:]}")
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def _latest_state(run: Path) -> dict:
    name = (run / "checkpoints" / "latest").read_text().strip()
    return json.loads((run / "checkpoints" / name / "trainer_state.json").read_text())


# ---------------------------------------------------------------- Ctrl-C
def test_ctrl_c_checkpoints_exits_130_with_a_resume_line_and_resume_continues(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.Popen(
        _train_cmd("rl.steps=400", "checkpoint.every=1000", f"output_dir={run}"),
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _wait_for(lambda: (run / "metrics.jsonl").exists() and len(_steps(run)) >= 3, proc, what="3 metrics records")
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err
    assert "SIGINT received: will save a checkpoint after this step" in err
    stopped = [line for line in err.splitlines() if line.startswith("stopped by SIGINT")]
    assert len(stopped) == 1 and "checkpoint" in stopped[0]
    hint = err.strip().splitlines()[-1]
    assert hint.startswith("resume with: ") and hint.endswith("--resume"), hint
    state = _latest_state(run)
    assert state["step"] == _steps(run)[-1] >= 2  # no step lost: the checkpoint holds the last logged step
    assert not list((run / "checkpoints").glob(".tmp_*"))
    # the printed command, run as printed by a shell in another directory (no venv on PATH, so the tool's
    # own path; the config file and output_dir absolute), with 2 more steps instead of the 400
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    printed = hint.removeprefix("resume with: ")
    fewer = printed.removesuffix(" --resume") + f" rl.steps={state['step'] + 2} --resume"  # later overrides win
    more = subprocess.run(fewer, shell=True, cwd=elsewhere, env=_env(), capture_output=True, text=True, timeout=300)
    assert more.returncode == 0, more.stderr[-2000:]
    assert _steps(run) == list(range(state["step"] + 3))
    assert more.stdout.startswith("done: grpo step") and "checkpoint" in more.stdout


def test_second_ctrl_c_aborts_at_once_and_then_resume_refuses_a_fresh_start(tmp_path):
    run = tmp_path / "run"
    # every=0: no periodic checkpoint; the delay hook makes the stop checkpoint slow to write
    proc = subprocess.Popen(
        _train_cmd("rl.steps=400", "checkpoint.every=0", f"output_dir={run}"),
        cwd=ROOT,
        env=_env(NEMO_GRANULAR_TEST_CHECKPOINT_DELAY="20"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _wait_for(lambda: (run / "metrics.jsonl").exists() and len(_steps(run)) >= 2, proc, what="2 metrics records")
    proc.send_signal(signal.SIGINT)
    time.sleep(0.5)  # in the step, or already inside the (slow) checkpoint write
    t0 = time.time()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert time.time() - t0 < 10  # at once: not after the 20 s checkpoint write
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err and "aborted by a second Ctrl-C" in err.strip().splitlines()[-1]
    assert not step_dirs(run / "checkpoints")  # no checkpoint was completed
    before = (run / "metrics.jsonl").read_text()
    # nothing to resume: a one-line error, never a fresh start over the metrics already written
    again = _cli("rl.steps=400", f"output_dir={run}", "--resume")
    assert again.returncode == 2 and again.stderr.strip().count("\n") == 0, again.stderr
    assert "nothing to resume" in again.stderr and str(run) in again.stderr
    fresh = _cli("rl.steps=400", f"output_dir={run}")
    assert fresh.returncode == 2 and "already holds a run" in fresh.stderr and "--force" in fresh.stderr
    assert (run / "metrics.jsonl").read_text() == before


# ---------------------------------------------------------------- kill -9 in the middle of a checkpoint write
@pytest.mark.slow
def test_kill9_during_checkpoint_write_then_resume_matches_an_uninterrupted_run(tmp_path):
    args = ["rl.steps=4", "checkpoint.every=2", "checkpoint.keep=10"]
    full = _cli(*args, f"output_dir={tmp_path / 'full'}")
    assert full.returncode == 0, full.stderr[-2000:]

    run = tmp_path / "killed"
    proc = subprocess.Popen(
        _train_cmd(*args, f"output_dir={run}"),
        cwd=ROOT,
        env=_env(NEMO_GRANULAR_TEST_CHECKPOINT_DELAY="3"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    ckpts = run / "checkpoints"
    # the step-4 checkpoint is being written: weights on disk, optimizer state not yet
    _wait_for(
        lambda: any((p / "policy" / "model.safetensors").exists() for p in ckpts.glob(".tmp_step_000004_*")),
        proc,
        what="the step-4 checkpoint write",
    )
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert [p.name for p in step_dirs(ckpts)] == ["step_000002"]  # the half-written one is not a checkpoint
    assert list(ckpts.glob(".tmp_step_000004_*"))
    resumed = _cli(*args, f"output_dir={run}", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resuming at step 2 of 4 from {ckpts / 'step_000002'}" in resumed.stderr, resumed.stderr[-2000:]
    assert not list(ckpts.glob(".tmp_*"))  # the leftover was cleaned up
    assert _records(run) == _records(tmp_path / "full")
    superseded = run / "metrics.superseded.jsonl"  # steps 3-4 were logged before the kill and redone
    assert [json.loads(line)["step"] for line in superseded.read_text().splitlines()] == [3, 4]


# ---------------------------------------------------------------- corrupt checkpoints: validation and fallback
@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A grpo run of 4 steps with checkpoints at steps 2 and 4 (in-process)."""
    from nemo_granular.embedded.trainer import Trainer

    out = tmp_path_factory.mktemp("finished") / "run"
    t = Trainer(
        load_train_config(
            LOCAL_CONFIGS / "grpo.yaml",
            TINY + [f"output_dir={out}", "rl.steps=4", "checkpoint.every=2", "checkpoint.keep=10"],
        ),
        log=lambda m: None,
    )
    assert t.run() == 0
    return out


def _copy(run: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(run, dst)
    return dst


def _truncate(path: Path, keep: float = 0.5):
    os.truncate(path, int(path.stat().st_size * keep))


CORRUPTIONS = {
    "truncated safetensors": ("policy/model.safetensors", lambda p: _truncate(p)),
    "truncated safetensors, no manifest": (
        "policy/model.safetensors",
        lambda p: (_truncate(p), (p.parents[1] / "manifest.json").unlink()),
    ),
    "truncated optimizer.pt": ("optimizer.pt", lambda p: _truncate(p)),
    "garbage optimizer.pt (same size)": ("optimizer.pt", lambda p: p.write_bytes(b"\0" * p.stat().st_size)),
    "broken trainer_state.json": ("trainer_state.json", lambda p: p.write_text('{"step": 4, "sampl')),
    "missing rng.pt": ("rng.pt", lambda p: p.unlink()),
    "missing tokenizer": ("tokenizer", lambda p: shutil.rmtree(p)),
    "broken policy config.json": ("policy/config.json", lambda p: p.write_text("{")),
}


def _resume(run: Path, logs: list, steps: int = 4):
    from nemo_granular.embedded.trainer import Trainer

    cfg = load_train_config(
        LOCAL_CONFIGS / "grpo.yaml",
        TINY + [f"output_dir={run}", f"rl.steps={steps}", "checkpoint.every=2", "checkpoint.keep=10"],
    )
    return Trainer(cfg, resume=True, log=logs.append)


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_resume_falls_back_to_the_newest_complete_checkpoint(finished_run, tmp_path, case):
    run = _copy(finished_run, tmp_path)
    rel, corrupt = CORRUPTIONS[case]
    corrupt(run / "checkpoints" / "step_000004" / rel)
    logs: list[str] = []
    t = _resume(run, logs)
    warnings = [m for m in logs if m.startswith("warning:")]
    assert len(warnings) == 1 and "\n" not in warnings[0], logs
    assert str(run / "checkpoints" / "step_000004") in warnings[0]  # names the broken file (or folder)
    assert rel.split("/")[0] in warnings[0] and "resuming from step_000002" in warnings[0]
    assert t.step == 2
    assert t.run() == 0
    assert _steps(run) == [0, 1, 2, 3, 4]
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert "step_000004.unusable" in names and "step_000004" in names  # kept aside, then rewritten
    assert _latest_state(run)["step"] == 4


def test_latest_naming_a_missing_checkpoint_falls_back_with_a_warning(finished_run, tmp_path):
    run = _copy(finished_run, tmp_path)
    (run / "checkpoints" / "latest").write_text("step_000006\n")
    logs: list[str] = []
    t = _resume(run, logs, steps=6)
    t.close()
    assert t.step == 4
    assert any("names step_000006, which does not exist" in m and "resuming from step_000004" in m for m in logs)


def test_no_complete_checkpoint_is_a_one_line_error_naming_the_file(finished_run, tmp_path):
    run = _copy(finished_run, tmp_path)
    for step in ("step_000002", "step_000004"):
        _truncate(run / "checkpoints" / step / "optimizer.pt")
    before = sorted(str(p) for p in run.rglob("*"))
    with pytest.raises(CheckpointError) as err:
        _resume(run, [])
    msg = str(err.value)
    assert "\n" not in msg and str(run / "checkpoints" / "step_000004" / "optimizer.pt") in msg
    assert sorted(str(p) for p in run.rglob("*")) == before  # nothing moved or written
    cli = _cli("rl.steps=4", f"output_dir={run}", "--resume")
    assert cli.returncode == 2 and cli.stderr.strip().count("\n") == 0, cli.stderr
    assert "optimizer.pt" in cli.stderr and "no complete checkpoint" in cli.stderr


def test_resume_checks_the_checkpoint_belongs_to_this_run(finished_run, tmp_path):
    run = _copy(finished_run, tmp_path)
    from nemo_granular.embedded.trainer import Trainer

    cfg = load_train_config(LOCAL_CONFIGS / "sspo.yaml", TINY + [f"output_dir={run}", "rl.steps=4"])
    with pytest.raises(ValueError, match="algorithm='grpo'.*algorithm='sspo'"):
        Trainer(cfg, resume=True, log=lambda m: None)


# ---------------------------------------------------------------- overwrite refusal, --force, nothing truncated
def test_fresh_run_into_an_existing_run_is_refused_and_force_starts_clean(finished_run, tmp_path):
    from nemo_granular.embedded.trainer import Trainer

    run = _copy(finished_run, tmp_path)
    snapshot = {str(p): p.read_bytes() for p in run.rglob("*") if p.is_file()}
    cfg = load_train_config(LOCAL_CONFIGS / "grpo.yaml", TINY + [f"output_dir={run}", "rl.steps=1"])
    with pytest.raises(FileExistsError, match="already holds a run.*--resume.*--force"):
        Trainer(cfg, log=lambda m: None)
    assert {str(p): p.read_bytes() for p in run.rglob("*") if p.is_file()} == snapshot
    empty = load_train_config(LOCAL_CONFIGS / "grpo.yaml", TINY + [f"output_dir={tmp_path / 'empty'}"])
    with pytest.raises(NothingToResume, match="nothing to resume"):
        Trainer(empty, resume=True, log=lambda m: None)
    assert not (tmp_path / "empty").exists()
    logs: list[str] = []
    t = Trainer(cfg, force=True, log=logs.append)
    assert t.run() == 0
    assert any(m.startswith("--force: removed the earlier run's") for m in logs)
    assert _steps(run) == [0, 1]  # no old records, and no old checkpoints mixed in
    assert [p.name for p in step_dirs(run / "checkpoints")] == ["step_000001"]


def test_auto_resume_starts_fresh_only_without_a_checkpoint(finished_run, tmp_path):
    from nemo_granular.embedded.trainer import Trainer

    fresh = load_train_config(LOCAL_CONFIGS / "grpo.yaml", TINY + [f"output_dir={tmp_path / 'new'}", "rl.steps=1"])
    t = Trainer(fresh, resume="auto", log=lambda m: None)
    assert not t.resumed and t.run() == 0
    run = _copy(finished_run, tmp_path)
    cfg = load_train_config(LOCAL_CONFIGS / "grpo.yaml", TINY + [f"output_dir={run}", "rl.steps=5"])
    t = Trainer(cfg, resume="auto", log=lambda m: None)
    assert t.resumed and t.step == 4 and t.run() == 0
    assert _steps(run) == [0, 1, 2, 3, 4, 5]


def test_a_line_cut_short_by_a_kill_is_kept_aside_on_resume(finished_run, tmp_path):
    run = _copy(finished_run, tmp_path)
    with (run / "metrics.jsonl").open("a") as fh:
        fh.write('{"step": 5, "samples": 8')  # the process died mid-write
    logs: list[str] = []
    t = _resume(run, logs, steps=5)
    assert t.run() == 0
    assert _steps(run) == [0, 1, 2, 3, 4, 5]
    assert (run / "metrics.superseded.jsonl").read_text() == '{"step": 5, "samples": 8\n'


# ---------------------------------------------------------------- what a user sees
def test_start_line_progress_lines_and_closing_summary(tmp_path):
    run = tmp_path / "run"
    res = _cli("rl.steps=3", "rl.eval_every=2", f"output_dir={run}")
    assert res.returncode == 0, res.stderr[-2000:]
    lines = [line for line in res.stderr.splitlines() if line.startswith(("train ", "step ", "done:"))]
    assert lines[0].startswith("train grpo (seed 0) on cpu: 3 RL steps") and str(run) in lines[0]
    assert [line.split(":")[0] for line in lines[1:]] == ["step 1/3", "step 2/3", "step 3/3"]  # progress: stderr
    assert "acc" in lines[1] and "nan" not in res.stderr  # the last known accuracy, never a placeholder
    (done,) = res.stdout.strip().splitlines()  # the summary: stdout, alone
    assert done.startswith("done: grpo step 3/3")
    assert "held-out accuracy" in done and str(run / "checkpoints" / "step_000003") in done
    assert str(run / "metrics.jsonl") in done
