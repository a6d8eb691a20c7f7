"""``nemo_granular.nemo_rl.time_limit``: NeMo-RL's time limit and SIGUSR1 become exit 99.

World: NeMo-RL (``nemo_rl_src``): the real ``TimeoutChecker`` of ``nemo_rl/utils/timer.py``, bound
in a module the way ``nemo_rl.algorithms.grpo`` / ``ppo`` bind it, and driven the way their loops
drive it (``start_iterations``; per step ``mark_iteration`` then ``check_save``). The loop on a
real Slurm cluster, requeue and resume included, is in ``tests/test_slurm.py``.
"""

from __future__ import annotations

import os
import signal
import time
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
def usr1(monkeypatch):
    """SIGUSR1 / SIGTERM through ``install_stop_signal``; the handlers, the module state and the
    job's end restored after (no Slurm job: the budget is NeMo-RL's alone unless a test sets one)."""
    old = {sig: signal.getsignal(sig) for sig in (signal.SIGUSR1, signal.SIGTERM)}
    for var in ("NG_JOB_END_TIME", "SLURM_JOB_END_TIME", "SLURM_JOB_ID", "NG_SAVE_RESERVE_SECONDS"):
        monkeypatch.delenv(var, raising=False)
    time_limit._STOP["signal"] = None
    time_limit._JOB["deadline"] = None
    yield
    time_limit._STOP["signal"] = None
    time_limit._JOB["deadline"] = None
    for sig, handler in old.items():
        signal.signal(sig, handler)


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


@pytest.mark.nemo_rl
def test_time_limit_before_the_end_is_exit_99_and_the_class_is_given_back(algo):
    original = algo.TimeoutChecker
    state = State()
    with StopWatch(algo) as watch:
        assert algo.TimeoutChecker is not original and issubclass(algo.TimeoutChecker, original)
        stopped = _loop(algo, "00:00:00:00", state, steps=10, max_steps=10)   # the limit is already up
    assert algo.TimeoutChecker is original
    assert stopped == 1 and watch.fired == "time limit"
    assert watch.exit_code(state, {"max_num_steps": 10, "max_num_epochs": 1}, {"enabled": True}) == PREEMPTED_EXIT_CODE


@pytest.mark.nemo_rl
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


@pytest.mark.nemo_rl
def test_no_limit_no_signal_is_exit_0_and_no_checkpointing_is_exit_1(algo, capsys):
    with StopWatch(algo) as watch:
        assert _loop(algo, None, State(), steps=5, max_steps=5) == 5
    assert watch.fired is None and watch.exit_code(State(), {"max_num_steps": 5}, {"enabled": True}) == 0
    with StopWatch(algo) as watch:
        _loop(algo, "00:00:00:00", State(), steps=5, max_steps=5)
    assert watch.exit_code(State(), {"max_num_steps": 5}, {"enabled": False}) == 1
    assert "cannot resume" in capsys.readouterr().err


@pytest.mark.nemo_rl
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


@pytest.mark.nemo_rl
def test_sigterm_stops_at_the_next_step_boundary_like_sigusr1(algo, capsys):
    """``scancel`` and Slurm's preemption send SIGTERM to every step, the driver's too: the driver
    must save at the end of the step and exit 99, not die (it handled only SIGUSR1 before)."""
    install_stop_signal()
    state = State()
    with StopWatch(algo) as watch:
        timeout = algo.TimeoutChecker(timeout=None, fit_last_save_time=True)
        timeout.start_iterations()
        os.kill(os.getpid(), signal.SIGTERM)                     # the process lives on
        timeout.mark_iteration()
        assert timeout.check_save() is True
        state.current_step = state.total_steps = 3
    assert watch.fired == "SIGTERM" and signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    assert watch.exit_code(state, {"max_num_steps": 6}, {"enabled": True}) == PREEMPTED_EXIT_CODE
    assert "stopped by SIGTERM after step 3 of 6: checkpoint saved; exit 99" in capsys.readouterr().err


@pytest.mark.nemo_rl
@pytest.mark.parametrize("must_save_by, left, reserve, expected", [
    ("00:03:45:00", 3600.0, 900.0, 2700.0),     # the job ends first: its end minus the reserve
    ("00:00:30:00", 7200.0, 900.0, 1800.0),     # NeMo-RL's own limit first: unchanged
    (None, 1000.0, 900.0, 100.0),               # no NeMo-RL limit: the job's end still counts
    ("00:03:45:00", 600.0, 900.0, 0.0),         # less left than the reserve: save at the first step
])
def test_the_budget_counts_from_the_driver_start_and_ends_before_the_job(algo, monkeypatch, must_save_by, left,
                                                                          reserve, expected):
    """The checker NeMo-RL builds after its setup fires at NeMo-RL's ``checkpoint_must_save_by``
    or at the Slurm job's end (recorded when the driver started) minus NG_SAVE_RESERVE_SECONDS,
    whichever comes first. Setup time spent before the checker is built counts against the job."""
    monkeypatch.setenv("NG_JOB_END_TIME", str(int(time.time() + left)))
    monkeypatch.setenv("NG_SAVE_RESERVE_SECONDS", str(reserve))
    install_stop_signal()
    deadline = time_limit._JOB["deadline"]
    assert abs(deadline - (time.time() + left)) <= 2
    with StopWatch(algo):
        timeout = algo.TimeoutChecker(timeout=must_save_by, fit_last_save_time=True)
    # independent: seconds from the checker's start to min(NeMo-RL's limit, job end - reserve)
    own = float("inf") if must_save_by is None else sum(
        int(x) * m for x, m in zip(must_save_by.split(":"), (86400, 3600, 60, 1)))
    want = max(min(own, deadline - reserve - timeout.start_time), 0.0)
    assert timeout.last_save_time == pytest.approx(want, abs=1e-6)
    assert abs(timeout.last_save_time - expected) <= 3
    if expected == 0.0:
        timeout.start_iterations()
        timeout.mark_iteration()
        assert timeout.check_save() is True


def test_job_seconds_left_reads_the_launcher_then_slurm(monkeypatch):
    assert time_limit.job_seconds_left({}) is None                       # not a Slurm job
    now = time.time()
    assert abs(time_limit.job_seconds_left({"NG_JOB_END_TIME": str(int(now) + 100)}) - 100) <= 2
    assert abs(time_limit.job_seconds_left({"SLURM_JOB_END_TIME": str(int(now) + 50)}) - 50) <= 2
    for text, seconds in (("1-02:03:04", 93784), ("02:03:04", 7384), ("03:04", 184), ("5", 5)):
        assert time_limit.parse_slurm_duration(text) == seconds
    for text in ("UNLIMITED", "NOT_SET", "INVALID", ""):
        assert time_limit.parse_slurm_duration(text) is None
