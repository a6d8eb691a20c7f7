"""NeMo-RL's time limit and SIGUSR1 as a resumable stop of ``run_grpo`` / ``run_sppo``.

NeMo-RL's loops (``grpo_train``, ``async_grpo_train``, ``ppo_train``, ``async_ppo_train`` at
7ea279ab) stop at ``checkpointing.checkpoint_must_save_by`` by saving a checkpoint and *returning*,
exactly as they return after their last step (``nemo_rl/algorithms/grpo.py:3797-3809``). The driver
then exited 0 either way, and ``slurm/launch.sh`` recorded a run cut at the time limit as
finished: never requeued, and the comparison report was built on the partial run.

:class:`StopWatch` rebinds ``TimeoutChecker`` in the algorithm module for the duration of the
training call (the loop looks the class up when it starts) with a subclass that records when
NeMo-RL's own limit fired, and that also fires at the next step boundary once SIGUSR1 has come
(the launcher's "save a checkpoint and stop" signal, see :func:`install_stop_signal`): NeMo-RL
then saves through its own checkpoint path and returns, so nothing is ever cut off in the middle
of a save. :meth:`StopWatch.exit_code` tells the launcher what happened: 0 when the run reached
its end, :data:`PREEMPTED_EXIT_CODE` when it stopped early with a checkpoint (requeue and resume),
1 when it stopped early without one (``checkpointing.enabled: false``).
"""

from __future__ import annotations

import signal
import sys
import threading
from types import ModuleType
from typing import Any

__all__ = ["PREEMPTED_EXIT_CODE", "StopWatch", "install_stop_signal", "stop_requested"]

PREEMPTED_EXIT_CODE = 99   # slurm/launch.sh's PREEMPT_EXIT_CODE, the embedded trainer's too
_STOP: dict[str, str | None] = {"signal": None}


def _on_stop_signal(signum, _frame) -> None:
    if _STOP["signal"] is None:
        _STOP["signal"] = signal.Signals(signum).name
        print(f"received {_STOP['signal']}: NeMo-RL will save a checkpoint at the end of the current step and stop",
              file=sys.stderr, flush=True)


def install_stop_signal(sig: int = signal.SIGUSR1) -> None:
    """Make ``sig`` request a stop at the next step boundary instead of killing the process. Call
    it first thing in the driver (``slurm/launch.sh`` starts known drivers with the signal
    ignored until then)."""
    if threading.current_thread() is threading.main_thread():
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
    except TypeError:            # an endless loader (multiple dataloaders): no epochs
        return None


class StopWatch:
    """``watch = StopWatch(nemo_rl.algorithms.grpo).start()``, ``grpo_train(...)``, ``watch.stop()``
    (or ``with StopWatch(...) as watch:``), then ``return watch.exit_code(...)``."""

    def __init__(self, module: ModuleType):
        self.module = module
        self.fired: str | None = None      # "time limit" or the stop signal's name
        self._original = self._patched = None

    def start(self) -> StopWatch:
        base = getattr(self.module, "TimeoutChecker", None)
        if base is None:
            raise AttributeError(f"{self.module.__name__}.TimeoutChecker does not exist "
                                 "(NeMo-RL version mismatch? written against 7ea279ab)")
        watch = self

        class RecordingTimeoutChecker(base):
            """NeMo-RL's TimeoutChecker; also fires once at the step boundary after a stop signal."""

            def check_save(self) -> bool:
                if stop_requested() and not self.last_saved:
                    self.last_saved = True
                    watch.fired = stop_requested()
                    return True
                fired = super().check_save()
                if fired:
                    watch.fired = "time limit"
                return fired

        self._original = base
        self._patched = RecordingTimeoutChecker
        self.module.TimeoutChecker = RecordingTimeoutChecker
        return self

    def stop(self) -> None:
        """Give NeMo-RL its class back, and from now on ignore SIGUSR1: the loop is over, and a
        repeat of the launcher's signal must not kill the driver while it shuts down (at
        interpreter exit Python resets a Python-level handler to the default action, which for
        SIGUSR1 is to terminate; an ignored signal stays ignored)."""
        if getattr(self.module, "TimeoutChecker", None) is self._patched:
            self.module.TimeoutChecker = self._original
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGUSR1, signal.SIG_IGN)

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
        epochs_done = (max_num_epochs is not None and steps_per_epoch is not None
                       and int(_get(state, "current_epoch")) + 1 >= int(max_num_epochs)
                       and int(_get(state, "current_step")) >= steps_per_epoch)
        if checkpointing and (done >= max_num_steps or epochs_done):
            return 0
        why = ("NeMo-RL's time limit (checkpointing.checkpoint_must_save_by)" if self.fired == "time limit"
               else self.fired)
        if not checkpointing:
            print(f"stopped by {why} with checkpointing.enabled: false: the run is incomplete and cannot resume",
                  file=sys.stderr, flush=True)
            return 1
        print(f"stopped {'at' if self.fired == 'time limit' else 'by'} {why} after step {done} of {max_num_steps}: "
              f"checkpoint saved; exit {PREEMPTED_EXIT_CODE} so that slurm/launch.sh requeues the job and NeMo-RL "
              f"resumes from it", file=sys.stderr, flush=True)
        return PREEMPTED_EXIT_CODE
