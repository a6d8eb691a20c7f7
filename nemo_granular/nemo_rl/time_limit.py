"""NeMo-RL's time limit and SIGUSR1 as a resumable stop of ``run_grpo`` / ``run_sppo``.

NeMo-RL's loops (``grpo_train``, ``async_grpo_train``, ``ppo_train``, ``async_ppo_train`` at
7ea279ab) stop at ``checkpointing.checkpoint_must_save_by`` by saving a checkpoint and *returning*,
exactly as they return after their last step (``nemo_rl/algorithms/grpo.py:3797-3809``). The driver
then exited 0 either way, and ``slurm/launch.sh`` recorded a run cut at the time limit as
finished: never requeued, and the comparison report was built on the partial run.

:class:`StopWatch` rebinds ``TimeoutChecker`` in the algorithm module for the duration of the
training call (the loop looks the class up when it starts) with a subclass that records when
NeMo-RL's own limit fired, and that also fires at the next step boundary once SIGUSR1 (the
launcher's "save a checkpoint and stop" signal, forwarded from the batch shell; see
:func:`install_stop_signal`) or SIGTERM has come: NeMo-RL then saves through its own checkpoint
path and returns, so the signal never cuts a save in the middle. Under ``slurm/launch.sh`` only
SIGUSR1 leads to that save (in time only if the current step and the save end before the job's
time limit: the time budget below starts the last save earlier). SIGTERM (``scancel``, Slurm's
preemption, the time limit) reaches every job step, the Ray head and worker steps too, and Ray
stops under the driver before the step ends: no checkpoint is saved, and a job that Slurm
requeues resumes from the last periodic checkpoint (``checkpointing.save_period``).
:meth:`StopWatch.exit_code` tells the launcher what happened: 0 when the run reached its end,
:data:`PREEMPTED_EXIT_CODE` when it stopped early with a checkpoint (requeue and resume), 1 when it
stopped early without one (``checkpointing.enabled: false``).

The job's time budget: NeMo-RL's ``TimeoutChecker`` counts ``checkpoint_must_save_by`` from its
construction inside the training loop, i.e. after setup (Ray, Megatron init, vLLM, checkpoint
conversion), which on a cluster can take a large share of the job. :func:`install_stop_signal`
(first thing in the driver) also records how much time the Slurm job has left
(:func:`job_seconds_left`); the checker then fires at NeMo-RL's own limit, or at the first step
boundary where less of the job is left than one more step and a save (:func:`must_stop_now`): the
longest of the last :data:`RECENT_STEPS` steps (not their mean: a slow step, e.g. one with a
validation, must not be averaged away) plus the last checkpoint save as NeMo-RL's own ``Timer``
measured it (its ``"checkpointing"`` section) and :data:`SHUTDOWN_SECONDS`, or, until a save has
been measured, ``NG_SAVE_RESERVE_SECONDS`` (default 900: the save and the shutdown).

Periodic saves by wall time: a preemption that gives no notice (SIGTERM to every step, a lost node)
loses the work since the last checkpoint, and ``checkpointing.save_period`` counts steps, whose
length a user learns only on the cluster. With ``NG_SAVE_EVERY_MINUTES=M`` (:func:`save_every_seconds`)
the checker also makes the loop save at the first step boundary M minutes after the last save (or
after the loop started). NeMo-RL's loops decide each step's save from
``(step + 1) % master_config.checkpointing["save_period"]`` after ``timeout.mark_iteration()`` and
before ``timeout.check_save()`` (``grpo.py:3504-3519``, ``ppo.py:1803-1814`` at 7ea279ab; the async
GRPO loop decides before its mark, so there the save comes one step later): ``mark_iteration`` sets
``save_period`` to 1 when a save is due; ``check_save`` and the start of a save (``Timer`` section
``"checkpointing"``, which every loop's save runs in) put the user's value back, so the config a
checkpoint records is the user's. The end of any save restarts the clock.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from types import ModuleType
from typing import Any

__all__ = [
    "PREEMPTED_EXIT_CODE",
    "StopWatch",
    "install_stop_signal",
    "stop_requested",
    "job_seconds_left",
    "parse_slurm_duration",
    "must_stop_now",
    "save_every_seconds",
    "check_save_every",
    "SAVE_EVERY_VAR",
]

PREEMPTED_EXIT_CODE = 99  # slurm/launch.sh's PREEMPT_EXIT_CODE, the embedded trainer's too
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
DEFAULT_SAVE_RESERVE_SECONDS = 900.0
RECENT_STEPS = 5  # the steps whose longest sizes the next one
# after a measured save: the driver's exit and the launcher's requeue (Ray steps stopped, the job's
# containers removed, scontrol requeue), which must also end before the time limit
SHUTDOWN_SECONDS = 120.0
SAVE_EVERY_VAR = "NG_SAVE_EVERY_MINUTES"
_STOP: dict[str, str | None] = {"signal": None}
_JOB: dict[str, float | None] = {"deadline": None}  # wall-clock time the Slurm job ends, when known


def parse_slurm_duration(text: str) -> float | None:
    """Seconds in Slurm's time format (``squeue -o %L``: ``[D-]HH:MM:SS``, ``MM:SS``, ``SS``);
    None for ``UNLIMITED``, ``NOT_SET``, ``INVALID`` or anything else."""
    m = re.fullmatch(r"(?:(\d+)-)?(?:(?:(\d+):)?(\d+):)?(\d+)", text.strip())
    if not m:
        return None
    d, h, mi, s = (int(x) if x else 0 for x in m.groups())
    return float(((d * 24 + h) * 60 + mi) * 60 + s)


def job_seconds_left(environ=os.environ) -> float | None:
    """How long the Slurm job has left, now: ``NG_JOB_END_TIME`` (epoch seconds; slurm/launch.sh
    sets it, since a container has no Slurm commands), else ``SLURM_JOB_END_TIME``, else
    ``squeue -h -j $SLURM_JOB_ID -o %L``. None outside Slurm or without a time limit."""
    for var in ("NG_JOB_END_TIME", "SLURM_JOB_END_TIME"):
        value = environ.get(var, "").strip()
        if value.isdigit() and int(value) > 0:
            return float(value) - time.time()
    job = environ.get("SLURM_JOB_ID")
    if not job or shutil.which("squeue") is None:
        return None
    try:
        out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_slurm_duration(out.stdout) if out.returncode == 0 else None


def save_every_seconds(environ=os.environ) -> float | None:
    """``NG_SAVE_EVERY_MINUTES`` in seconds (unset or empty: None, no periodic saves by wall time);
    one-line ``ValueError`` for a value that is not a positive number of minutes."""
    value = environ.get(SAVE_EVERY_VAR, "").strip()
    if not value:
        return None
    try:
        minutes = float(value)
    except ValueError:
        minutes = float("nan")
    if not minutes > 0 or minutes == float("inf"):
        raise ValueError(
            f"{SAVE_EVERY_VAR}={value!r}: must be a positive number of minutes (unset: no periodic saves by wall time)"
        )
    return minutes * 60.0


def check_save_every(checkpointing_enabled: bool, environ=os.environ) -> None:
    """The driver's start-up check: ``NG_SAVE_EVERY_MINUTES`` valid, and only with checkpoints on."""
    if save_every_seconds(environ) is not None and not checkpointing_enabled:
        raise ValueError(
            f"{SAVE_EVERY_VAR}={environ[SAVE_EVERY_VAR].strip()} asks for periodic checkpoints, but "
            "checkpointing.enabled is false"
        )


def save_reserve_seconds(environ=os.environ) -> float:
    value = environ.get("NG_SAVE_RESERVE_SECONDS", "").strip()
    return float(value) if value else DEFAULT_SAVE_RESERVE_SECONDS


def must_stop_now(seconds_left: float, recent_step_seconds, last_save_seconds: float | None, reserve: float) -> bool:
    """Whether the run must save and stop at this step boundary: less of the job is left than the
    longest of the last :data:`RECENT_STEPS` steps plus the last save and :data:`SHUTDOWN_SECONDS`
    (``reserve``, NG_SAVE_RESERVE_SECONDS, while no save has been measured)."""
    step = max(list(recent_step_seconds)[-RECENT_STEPS:], default=0.0)
    after = reserve if last_save_seconds is None else last_save_seconds + SHUTDOWN_SECONDS
    return seconds_left < step + after


def _on_stop_signal(signum, _frame) -> None:
    if _STOP["signal"] is None:
        _STOP["signal"] = signal.Signals(signum).name
        print(
            f"received {_STOP['signal']}: NeMo-RL will save a checkpoint at the end of the current step and stop",
            file=sys.stderr,
            flush=True,
        )


def install_stop_signal(sigs: tuple[int, ...] = STOP_SIGNALS) -> None:
    """Make each of ``sigs`` (SIGUSR1: the launcher's signal before the time limit; SIGTERM:
    ``scancel`` and preemption, sent by Slurm to every step) request a stop at the next step
    boundary instead of killing the process, and record the job's end (:func:`job_seconds_left`).
    Call it first thing in the driver (``slurm/launch.sh`` starts known drivers with both signals
    ignored until then)."""
    left = job_seconds_left()
    _JOB["deadline"] = None if left is None else time.time() + left
    if threading.current_thread() is threading.main_thread():
        for sig in sigs:
            signal.signal(sig, _on_stop_signal)


def stop_requested() -> str | None:
    """The name of the stop signal received so far, or None."""
    return _STOP["signal"]


def _get(obj: Any, key: str, default: Any = 0) -> Any:
    """``obj[key]`` or ``obj.key`` (NeMo-RL's configs and save states come as both)."""
    value = obj.get(key, default) if isinstance(obj, dict) else getattr(obj, key, default)
    return default if value is None else value


def _length(dataloader: Any) -> int | None:
    try:
        return len(dataloader)
    except TypeError:  # an endless loader (multiple dataloaders): no epochs
        return None


class StopWatch:
    """``watch = StopWatch(nemo_rl.algorithms.grpo).start()``, ``grpo_train(...)``, ``watch.stop()``
    (or ``with StopWatch(...) as watch:``), then ``return watch.exit_code(...)``."""

    def __init__(self, module: ModuleType, checkpointing: Any = None):
        """``checkpointing``: the ``master_config.checkpointing`` dict the loop reads (periodic saves by
        wall time need it; without it ``NG_SAVE_EVERY_MINUTES`` is ignored)."""
        self.module = module
        self.checkpointing = checkpointing
        self.save_every = save_every_seconds() if checkpointing is not None else None
        self.last_save_end: float | None = None  # when the last save ended (the loop's start before one)
        self.periodic_saves = 0
        self._user_period: Any = None  # the user's save_period while ours (1) stands in
        self.fired: str | None = None  # "time limit", "job end" or the stop signal's name
        self.last_save_seconds: float | None = None  # NeMo-RL's last "checkpointing" section
        self._saves_in_step = 0.0  # seconds saved since the last step boundary
        self._original = self._patched = None
        self._timer_original = self._timer_patched = None

    def _saved(self, seconds: float) -> None:
        self.last_save_seconds = seconds
        self._saves_in_step += seconds
        self.last_save_end = time.time()

    def _due(self, now: float) -> None:
        """At a step boundary: make this step's save decision save when the last one is older than
        ``save_every`` (see the module docstring)."""
        if self.save_every is None or self._user_period is not None:
            return
        since = now - (self.last_save_end if self.last_save_end is not None else now)
        if since < self.save_every:
            return
        self._user_period = self.checkpointing["save_period"]
        self.checkpointing["save_period"] = 1
        self.periodic_saves += 1
        self.last_save_end = now  # the save happens at this boundary (a loop without Timer, too)
        print(
            f"periodic checkpoint: {since / 60:.1f} min since the last one ({SAVE_EVERY_VAR}="
            f"{self.save_every / 60:g}): NeMo-RL saves at this step",
            file=sys.stderr,
            flush=True,
        )

    def _restore_period(self) -> None:
        if self._user_period is not None:
            self.checkpointing["save_period"] = self._user_period
            self._user_period = None

    def start(self) -> StopWatch:
        base = getattr(self.module, "TimeoutChecker", None)
        if base is None:
            raise AttributeError(
                f"{self.module.__name__}.TimeoutChecker does not exist "
                "(NeMo-RL version mismatch? written against 7ea279ab)"
            )
        watch = self

        class RecordingTimeoutChecker(base):
            """NeMo-RL's TimeoutChecker; also fires once at the step boundary after a stop signal,
            and when less of the Slurm job is left than a step and a save (:func:`must_stop_now`)."""

            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                self.step_seconds: list[float] = []  # each step, the saves in it left out
                self.step_started: float | None = None
                if watch.last_save_end is None:
                    watch.last_save_end = time.time()  # the periodic saves' clock starts with the loop
                if _JOB["deadline"] is not None:
                    reserve = save_reserve_seconds()
                    budget = _JOB["deadline"] - reserve - self.start_time
                    if budget < self.last_save_time:
                        print(
                            f"time limit: the Slurm job ends in {_JOB['deadline'] - self.start_time:.0f} s; NeMo-RL "
                            f"will save and stop within {max(budget, 0):.0f} s (job end minus "
                            f"NG_SAVE_RESERVE_SECONDS={reserve:.0f}) less its longest recent step, before "
                            f"checkpointing.checkpoint_must_save_by; once a save has been timed, that save plus "
                            f"{SHUTDOWN_SECONDS:.0f} s stands for the reserve",
                            file=sys.stderr,
                            flush=True,
                        )

            def start_iterations(self) -> None:
                super().start_iterations()
                self.step_started = time.time()

            def mark_iteration(self) -> None:
                # the time between two marks holds the save of the step before, if it saved: that
                # save is counted once, as the save, not again as a step
                super().mark_iteration()
                now = time.time()
                if self.step_started is not None:
                    self.step_seconds.append(max(now - self.step_started - watch._saves_in_step, 0.0))
                self.step_started, watch._saves_in_step = now, 0.0
                watch._due(now)

            def check_save(self) -> bool:
                watch._restore_period()  # the loop has read save_period for this step's decision
                if stop_requested() and not self.last_saved:
                    self.last_saved = True
                    watch.fired = stop_requested()
                    return True
                if super().check_save():
                    watch.fired = "time limit"
                    return True
                if self.last_saved or _JOB["deadline"] is None:
                    return False
                left, reserve = _JOB["deadline"] - time.time(), save_reserve_seconds()
                if not must_stop_now(left, self.step_seconds, watch.last_save_seconds, reserve):
                    return False
                self.last_saved = True
                watch.fired = "job end"
                step = max(self.step_seconds[-RECENT_STEPS:], default=0.0)
                after = (
                    f"NG_SAVE_RESERVE_SECONDS={reserve:.0f}"
                    if watch.last_save_seconds is None
                    else f"the last save ({watch.last_save_seconds:.0f} s) and {SHUTDOWN_SECONDS:.0f} s to shut down"
                )
                print(
                    f"time limit: {max(left, 0):.0f} s left in the Slurm job, less than the longest of the last "
                    f"{RECENT_STEPS} steps ({step:.0f} s) plus {after}: NeMo-RL saves now and stops",
                    file=sys.stderr,
                    flush=True,
                )
                return True

        self._original = base
        self._patched = RecordingTimeoutChecker
        self.module.TimeoutChecker = RecordingTimeoutChecker
        timer = getattr(self.module, "Timer", None)
        if timer is not None:  # without it no save is measured, and the reserve stays

            class SaveTimingTimer(timer):
                """NeMo-RL's Timer; also hands the watch each checkpoint save's duration (the loops
                save inside ``timer.time("checkpointing")``)."""

                def start(self, label, *args, **kwargs):
                    if label == "checkpointing":  # a save begins: it records the user's save_period
                        watch._restore_period()
                    return super().start(label, *args, **kwargs)

                def stop(self, label, *args, **kwargs):
                    elapsed = super().stop(label, *args, **kwargs)
                    if label == "checkpointing":
                        watch._saved(elapsed)
                    return elapsed

            self._timer_original, self._timer_patched = timer, SaveTimingTimer
            self.module.Timer = SaveTimingTimer
        return self

    def stop(self) -> None:
        """Give NeMo-RL its classes back, and from now on ignore the stop signals: the loop is over,
        and a repeat of the launcher's signal must not kill the driver while it shuts down (at
        interpreter exit Python resets a Python-level handler to the default action, which for
        SIGUSR1 and SIGTERM is to terminate; an ignored signal stays ignored)."""
        self._restore_period()
        if getattr(self.module, "TimeoutChecker", None) is self._patched:
            self.module.TimeoutChecker = self._original
        if self._timer_patched is not None and getattr(self.module, "Timer", None) is self._timer_patched:
            self.module.Timer = self._timer_original
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                signal.signal(sig, signal.SIG_IGN)

    def __enter__(self) -> StopWatch:
        return self.start()

    def __exit__(self, *exc) -> bool:
        self.stop()
        return False

    def exit_code(self, state: Any, algo_cfg: Any, checkpointing_cfg: Any, dataloader: Any = None) -> int:
        """0: finished; 99: stopped before the end with a checkpoint; 1: stopped without one.

        ``state`` is the save state the loop updated in place when it saved (``GRPOSaveState`` or
        the PPO dict): ``total_steps`` (``current_step`` in async GRPO). ``algo_cfg`` is the
        ``grpo`` / ``ppo`` section (``max_num_steps``, ``max_num_epochs``), ``dataloader`` the
        training loader (None where epochs do not bound the run, e.g. async GRPO). The end is
        reached at ``max_num_steps`` or after the last step of the last epoch. If the time limit
        and a validation early stop fall on the same step, this says "stopped early" and the
        requeued run continues (NeMo-RL's loop does not tell the two apart)."""
        if self.fired is None:
            return 0
        checkpointing = bool(_get(checkpointing_cfg, "enabled", False))
        max_num_steps, max_num_epochs = int(_get(algo_cfg, "max_num_steps")), _get(algo_cfg, "max_num_epochs", None)
        steps_per_epoch = None if dataloader is None else _length(dataloader)
        done = max(int(_get(state, "total_steps")), int(_get(state, "current_step")))
        epochs_done = (
            max_num_epochs is not None
            and steps_per_epoch is not None
            and int(_get(state, "current_epoch")) + 1 >= int(max_num_epochs)
            and int(_get(state, "current_step")) >= steps_per_epoch
        )
        if checkpointing and (done >= max_num_steps or epochs_done):
            return 0
        why = {
            "time limit": "NeMo-RL's time limit (checkpointing.checkpoint_must_save_by)",
            "job end": "the Slurm job's time limit",
        }.get(self.fired, self.fired)
        if not checkpointing:
            print(
                f"stopped by {why} with checkpointing.enabled: false: the run is incomplete and cannot resume",
                file=sys.stderr,
                flush=True,
            )
            return 1
        at = "at" if self.fired in ("time limit", "job end") else "by"
        print(
            f"stopped {at} {why} after step {done} of {max_num_steps}: "
            f"checkpoint saved; exit {PREEMPTED_EXIT_CODE} so that slurm/launch.sh requeues the job and NeMo-RL "
            f"resumes from it",
            file=sys.stderr,
            flush=True,
        )
        return PREEMPTED_EXIT_CODE
