"""``nemo_granular.nemo_rl.time_limit``: NeMo-RL's time limit and SIGUSR1 become exit 99.

World: NeMo-RL (``nemo_rl_src``): the real ``TimeoutChecker`` of ``nemo_rl/utils/timer.py``, bound
in a module the way ``nemo_rl.algorithms.grpo`` / ``ppo`` bind it, and driven the way their loops
drive it (``start_iterations``; per step ``mark_iteration`` then ``check_save``). The loop on a
real Slurm cluster, requeue and resume included, is in ``tests/test_slurm.py``.
"""

from __future__ import annotations

import os
import signal
import types
from dataclasses import dataclass

import pytest

from nemo_granular.nemo_rl import time_limit
from nemo_granular.nemo_rl.time_limit import PREEMPTED_EXIT_CODE, StopWatch, install_stop_signal


@dataclass
class State:          # the fields of NeMo-RL's GRPOSaveState the exit code reads
    current_step: int = 0
    total_steps: int = 0
    current_epoch: int = 0


@pytest.fixture
def algo(nemo_rl_src):
    from nemo_rl.utils.timer import TimeoutChecker

    module = types.ModuleType("algo")
    module.TimeoutChecker = TimeoutChecker
    return module


@pytest.fixture(autouse=True)
def usr1():
    """SIGUSR1 through ``install_stop_signal``; the handler and the module flag restored after."""
    old = signal.getsignal(signal.SIGUSR1)
    time_limit._STOP["signal"] = None
    yield
    time_limit._STOP["signal"] = None
    signal.signal(signal.SIGUSR1, old)


def _loop(algo, must_save_by, state: State, steps: int, max_steps: int, usr1_at: int | None = None) -> int:
    """The stop logic of grpo_train: the checker the module binds, updated state on a save, return."""
    timeout = algo.TimeoutChecker(timeout=must_save_by, fit_last_save_time=True)
    timeout.start_iterations()
    for step in range(state.total_steps + 1, steps + 1):
        if step == usr1_at:
            os.kill(os.getpid(), signal.SIGUSR1)
        timeout.mark_iteration()
        if timeout.check_save() or step == max_steps:
            state.current_step = state.total_steps = step
            return step
    return steps


def test_time_limit_before_the_end_is_exit_99_and_the_class_is_given_back(algo):
    original = algo.TimeoutChecker
    state = State()
    with StopWatch(algo) as watch:
        assert algo.TimeoutChecker is not original and issubclass(algo.TimeoutChecker, original)
        stopped = _loop(algo, "00:00:00:00", state, steps=10, max_steps=10)   # the limit is already up
    assert algo.TimeoutChecker is original
    assert stopped == 1 and watch.fired == "time limit"
    assert watch.exit_code(state, {"max_num_steps": 10, "max_num_epochs": 1}, {"enabled": True}) == PREEMPTED_EXIT_CODE


def test_time_limit_on_the_last_step_or_the_last_epoch_is_a_finished_run(algo):
    with StopWatch(algo) as watch:
        _loop(algo, "00:00:00:00", State(total_steps=9), steps=10, max_steps=10)
    assert watch.fired == "time limit"
    assert watch.exit_code(State(current_step=10, total_steps=10), {"max_num_steps": 10}, {"enabled": True}) == 0
    # epochs: 2 epochs of 4 steps, stopped after the 4th step of the 2nd epoch with max_num_steps far away
    last = State(current_step=4, total_steps=8, current_epoch=1)
    assert watch.exit_code(last, {"max_num_steps": 1000, "max_num_epochs": 2}, {"enabled": True}, range(4)) == 0
    mid = State(current_step=3, total_steps=7, current_epoch=1)
    assert watch.exit_code(mid, {"max_num_steps": 1000, "max_num_epochs": 2}, {"enabled": True}, range(4)) == 99


def test_no_limit_no_signal_is_exit_0_and_no_checkpointing_is_exit_1(algo, capsys):
    with StopWatch(algo) as watch:
        assert _loop(algo, None, State(), steps=5, max_steps=5) == 5
    assert watch.fired is None and watch.exit_code(State(), {"max_num_steps": 5}, {"enabled": True}) == 0
    with StopWatch(algo) as watch:
        _loop(algo, "00:00:00:00", State(), steps=5, max_steps=5)
    assert watch.exit_code(State(), {"max_num_steps": 5}, {"enabled": False}) == 1
    assert "cannot resume" in capsys.readouterr().err


def test_sigusr1_stops_at_the_next_step_boundary_through_the_checker(algo, usr1, capsys):
    install_stop_signal()
    state = {"current_step": 0, "total_steps": 0, "current_epoch": 0}      # NeMo-RL's PPO state is a dict
    with StopWatch(algo) as watch:
        timeout = algo.TimeoutChecker(timeout=None, fit_last_save_time=True)
        timeout.start_iterations()
        timeout.mark_iteration()
        assert timeout.check_save() is False                     # no limit, no signal
        os.kill(os.getpid(), signal.SIGUSR1)                     # the process lives on
        timeout.mark_iteration()
        assert timeout.check_save() is True and timeout.check_save() is False   # once, like NeMo-RL's
        state.update(current_step=2, total_steps=2)
    assert watch.fired == "SIGUSR1" and time_limit.stop_requested() == "SIGUSR1"
    # the loop is over: a repeat of the signal must not kill the driver while it shuts down
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_IGN
    assert watch.exit_code(state, {"max_num_steps": 6}, {"enabled": True}) == PREEMPTED_EXIT_CODE
    err = capsys.readouterr().err
    assert "received SIGUSR1" in err and "stopped by SIGUSR1 after step 2 of 6: checkpoint saved; exit 99" in err


def test_a_module_without_timeoutchecker_is_refused_in_one_line():
    with pytest.raises(AttributeError, match="TimeoutChecker does not exist"):
        StopWatch(types.ModuleType("nemo_rl.algorithms.other")).start()
