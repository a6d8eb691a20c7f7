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
class State:  # the fields of NeMo-RL's GRPOSaveState the exit code reads
    current_step: int = 0
    total_steps: int = 0
    current_epoch: int = 0


@pytest.fixture
def algo(nemo_rl_src):
    from nemo_rl.utils.timer import TimeoutChecker, Timer

    module = types.ModuleType("algo")
    module.TimeoutChecker, module.Timer = TimeoutChecker, Timer
    return module


class Clock:
    """``time.time`` and ``time.perf_counter`` (NeMo-RL's checker and Timer read them) that move only
    when the test says."""

    def __init__(self, monkeypatch):
        self.now = 1_000_000.0
        monkeypatch.setattr(time, "time", self)
        monkeypatch.setattr(time, "perf_counter", self)

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture(autouse=True)
def usr1(monkeypatch):
    """SIGUSR1 / SIGTERM through ``install_stop_signal``; the handlers, the module state and the
    job's end restored after (no Slurm job: the budget is NeMo-RL's alone unless a test sets one)."""
    old = {sig: signal.getsignal(sig) for sig in (signal.SIGUSR1, signal.SIGTERM)}
    for var in (
        "NG_JOB_END_TIME",
        "SLURM_JOB_END_TIME",
        "SLURM_JOB_ID",
        "NG_SAVE_RESERVE_SECONDS",
        "NG_SAVE_EVERY_MINUTES",
    ):
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
        stopped = _loop(algo, "00:00:00:00", state, steps=10, max_steps=10)  # the limit is already up
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
    state = {"current_step": 0, "total_steps": 0, "current_epoch": 0}  # NeMo-RL's PPO state is a dict
    with StopWatch(algo) as watch:
        timeout = algo.TimeoutChecker(timeout=None, fit_last_save_time=True)
        timeout.start_iterations()
        timeout.mark_iteration()
        assert timeout.check_save() is False  # no limit, no signal
        os.kill(os.getpid(), signal.SIGUSR1)  # the process lives on
        timeout.mark_iteration()
        assert timeout.check_save() is True and timeout.check_save() is False  # once, like NeMo-RL's
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
        os.kill(os.getpid(), signal.SIGTERM)  # the process lives on
        timeout.mark_iteration()
        assert timeout.check_save() is True
        state.current_step = state.total_steps = 3
    assert watch.fired == "SIGTERM" and signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    assert watch.exit_code(state, {"max_num_steps": 6}, {"enabled": True}) == PREEMPTED_EXIT_CODE
    assert "stopped by SIGTERM after step 3 of 6: checkpoint saved; exit 99" in capsys.readouterr().err


@pytest.mark.nemo_rl
@pytest.mark.parametrize(
    "must_save_by, left, reserve, at_once",
    [
        ("00:03:45:00", 3600.0, 900.0, False),  # the job ends first, but more than the reserve is left
        ("00:00:30:00", 7200.0, 900.0, False),  # NeMo-RL's own limit first: unchanged
        (None, 800.0, 900.0, True),  # no NeMo-RL limit: the job's end still counts
        ("00:03:45:00", 600.0, 900.0, True),  # less left than the reserve: save at the first step
    ],
)
def test_the_budget_counts_from_the_driver_start_and_ends_before_the_job(
    algo, monkeypatch, must_save_by, left, reserve, at_once
):
    """The checker NeMo-RL builds after its setup keeps NeMo-RL's ``checkpoint_must_save_by``, and
    also fires when less of the Slurm job (its end recorded when the driver started) is left than a
    step and a save: before any step or save is measured, NG_SAVE_RESERVE_SECONDS."""
    monkeypatch.setenv("NG_JOB_END_TIME", str(int(time.time() + left)))
    monkeypatch.setenv("NG_SAVE_RESERVE_SECONDS", str(reserve))
    install_stop_signal()
    deadline = time_limit._JOB["deadline"]
    assert abs(deadline - (time.time() + left)) <= 2
    with StopWatch(algo) as watch:
        timeout = algo.TimeoutChecker(timeout=must_save_by, fit_last_save_time=True)
        own = (
            float("inf")
            if must_save_by is None
            else sum(int(x) * m for x, m in zip(must_save_by.split(":"), (86400, 3600, 60, 1)))
        )
        assert timeout.last_save_time == own
        timeout.start_iterations()
        assert timeout.check_save() is at_once
    assert watch.fired == ("job end" if at_once else None)


def test_must_stop_now_takes_the_longest_recent_step_and_the_measured_save():
    """Hand-computed: stop when seconds_left < max(last 5 steps) + (last save + 120 s to shut down,
    or the reserve while no save was measured)."""
    must = time_limit.must_stop_now
    assert time_limit.RECENT_STEPS == 5 and time_limit.SHUTDOWN_SECONDS == 120
    # no save measured: the reserve (900) stands for the save and the shutdown
    assert must(1000, [100, 200, 150], None, 900) is True  # 200 + 900 = 1100
    assert must(1200, [100, 200, 150], None, 900) is False
    assert must(800, [], None, 900) is True  # nothing measured: 0 + 900
    # the longest step, not the mean: mean 180 + 320 = 500 < 800 would go on; max 500 + 320 = 820
    assert must(800, [100, 100, 100, 100, 500], 200, 900) is True
    assert must(830, [100, 100, 100, 100, 500], 200, 900) is False
    # only the last 5 steps: the slow first one (e.g. compilation) no longer counts
    assert must(500, [1000, 10, 10, 10, 10], 300, 900) is True  # 1000 + 420
    assert must(500, [1000, 10, 10, 10, 10, 10], 300, 900) is False  # 10 + 420 = 430
    # a measured save replaces the reserve, both ways: a fast one (100 + 60 + 120 = 280) ...
    assert must(600, [100], 60, 900) is False  # the reserve would stop: 1000
    # ... and a slow one (100 + 1300 + 120 = 1520)
    assert must(1500, [100], 1300, 900) is True  # the reserve would go on: 1000


@pytest.mark.nemo_rl
def test_the_job_end_fires_at_the_longest_recent_step_plus_the_last_save(algo, monkeypatch, capsys):
    """NeMo-RL's loop as it drives the checker (per step ``mark_iteration``, ``check_save``, then
    a save inside ``timer.time("checkpointing")``) on a clock the test moves. The job's end is
    recorded when the driver starts (1000 s of setup pass before NeMo-RL builds its checker), the
    save is measured by NeMo-RL's Timer and left out of the step it falls in, and a slow step (a
    validation) is not averaged away: NeMo-RL's mean with the 900 s reserve would go on at step 6."""
    clock = Clock(monkeypatch)
    monkeypatch.setenv("NG_JOB_END_TIME", str(int(clock.now + 4000)))
    monkeypatch.setenv("NG_SAVE_RESERVE_SECONDS", "900")
    install_stop_signal()
    clock.advance(1000)  # setup: 3000 s of the job are left
    state = State()
    with StopWatch(algo) as watch:
        timeout = algo.TimeoutChecker(timeout=None, fit_last_save_time=True)
        timer = algo.Timer()
        timeout.start_iterations()
        # (step seconds, save after it) -> left at its check, the rule's need, stop?
        plan = [
            (100, 200),  # left 2900; 100 + reserve 900 = 1000: go on; save 200 s
            (100, None),  # left 2600 (300 s since the last mark, 200 of them the save); 100 + 200 + 120
            (100, None),  # left 2500
            (1000, None),  # left 1500; a validation step: 1000 + 320 = 1320: go on
            (100, None),  # left 1400; 1320: go on
            (100, None),  # left 1300; the last 5 steps still hold the 1000: 1320 > 1300: stop
        ]
        fired_at = None
        for step, (seconds, save) in enumerate(plan, start=1):
            clock.advance(seconds)
            timeout.mark_iteration()
            if timeout.check_save():
                fired_at = step
                state.current_step = state.total_steps = step
                break
            if save is not None:
                with timer.time("checkpointing"):
                    clock.advance(save)
        assert fired_at == 6 and watch.fired == "job end"
        assert watch.last_save_seconds == 200
        assert timeout.step_seconds == [100, 100, 100, 1000, 100, 100]
    assert watch.exit_code(state, {"max_num_steps": 10}, {"enabled": True}) == PREEMPTED_EXIT_CODE
    err = capsys.readouterr().err
    assert (
        "time limit: 1300 s left in the Slurm job, less than the longest of the last 5 steps (1000 s) plus the "
        "last save (200 s) and 120 s to shut down: NeMo-RL saves now and stops"
    ) in err, err
    assert "stopped at the Slurm job's time limit after step 6 of 10: checkpoint saved; exit 99" in err, err


def test_job_seconds_left_reads_the_launcher_then_slurm(monkeypatch):
    assert time_limit.job_seconds_left({}) is None  # not a Slurm job
    now = time.time()
    assert abs(time_limit.job_seconds_left({"NG_JOB_END_TIME": str(int(now) + 100)}) - 100) <= 2
    assert abs(time_limit.job_seconds_left({"SLURM_JOB_END_TIME": str(int(now) + 50)}) - 50) <= 2
    for text, seconds in (("1-02:03:04", 93784), ("02:03:04", 7384), ("03:04", 184), ("5", 5)):
        assert time_limit.parse_slurm_duration(text) == seconds
    for text in ("UNLIMITED", "NOT_SET", "INVALID", ""):
        assert time_limit.parse_slurm_duration(text) is None


# ---------------------------------------------------------------- periodic saves by wall time -----


def test_save_every_minutes_is_a_positive_number_of_minutes_or_one_line():
    assert (
        time_limit.save_every_seconds({}) is None
        and time_limit.save_every_seconds({"NG_SAVE_EVERY_MINUTES": " "}) is None
    )
    assert time_limit.save_every_seconds({"NG_SAVE_EVERY_MINUTES": "30"}) == 1800.0
    assert time_limit.save_every_seconds({"NG_SAVE_EVERY_MINUTES": "0.5"}) == 30.0
    for bad in ("0", "-5", "ten", "inf", "nan"):
        with pytest.raises(ValueError) as err:
            time_limit.save_every_seconds({"NG_SAVE_EVERY_MINUTES": bad})
        assert str(err.value) == (
            f"NG_SAVE_EVERY_MINUTES={bad!r}: must be a positive number of minutes (unset: no "
            "periodic saves by wall time)"
        ), err.value
    time_limit.check_save_every(True, {"NG_SAVE_EVERY_MINUTES": "30"})
    time_limit.check_save_every(False, {})
    with pytest.raises(
        ValueError,
        match=r"^NG_SAVE_EVERY_MINUTES=30 asks for periodic checkpoints, but "
        r"checkpointing.enabled is false$",
    ):
        time_limit.check_save_every(False, {"NG_SAVE_EVERY_MINUTES": "30"})


@pytest.mark.nemo_rl
@pytest.mark.parametrize(
    "order, period, saves, due",
    [
        # grpo_train / ppo_train / async_ppo_train (7ea279ab) and v0.7.0's loops: mark, decide, check, save
        ("mark_first", 5, [3, 5, 8, 10, 13], 3),
        # async_grpo_train at 7ea279ab: decide, check, mark, save: the periodic save comes one step later
        ("decide_first", 5, [4, 5, 9, 10], 3),
        # ... and a save made due at the mark of a step that saves anyway is that save (with the user's period)
        ("decide_first", 3, [3, 6, 9, 12], 4),
    ],
)
def test_periodic_saves_by_wall_time_go_through_the_loops_own_save_decision(
    algo, monkeypatch, capsys, order, period, saves, due
):
    """NG_SAVE_EVERY_MINUTES=10 with steps of 4 min, saves of 1 min and ``save_period: 5``, driven
    as NeMo-RL's loops drive the real TimeoutChecker and Timer: the step decision reads
    ``checkpointing["save_period"]`` (``(step + 1) % save_period``), ``check_save`` follows it, a
    save runs inside ``timer.time("checkpointing")``. A save is due 10 min after the last one ended
    (or after the loop started); a step-period save restarts the clock; after every ``check_save``
    (before the save, which records the config) ``save_period`` is the user's 5 again."""
    clock = Clock(monkeypatch)
    monkeypatch.setenv("NG_SAVE_EVERY_MINUTES", "10")
    checkpointing = {"enabled": True, "save_period": period, "checkpoint_must_save_by": None}
    saved, seen_period = [], []
    with StopWatch(algo, checkpointing) as watch:
        timeout = algo.TimeoutChecker(timeout=None, fit_last_save_time=True)
        timer = algo.Timer()
        timeout.start_iterations()
        for step in range(1, 14):
            clock.advance(240)
            if order == "mark_first":
                timeout.mark_iteration()
            decided = step % checkpointing["save_period"] == 0
            assert not timeout.check_save()
            if order == "decide_first":
                timeout.mark_iteration()
            if decided:
                with timer.time("checkpointing"):
                    seen_period.append(checkpointing["save_period"])  # what init_tmp_checkpoint records
                    clock.advance(60)
                saved.append(step)
    # with period 5 due at the boundaries of minutes 12, 34, 56 (steps 3, 8, 13); in decide_first order
    # the third one's save would be step 14's, and leaving the loop gives save_period back
    assert saved == saves and watch.periodic_saves == due, saved
    assert set(seen_period) == {period} and checkpointing["save_period"] == period
    err = capsys.readouterr().err
    assert err.count("periodic checkpoint: ") == watch.periodic_saves, err
    assert (
        "periodic checkpoint: 12.0 min since the last one (NG_SAVE_EVERY_MINUTES=10): NeMo-RL saves at this step" in err
    ), err


@pytest.mark.nemo_rl
def test_without_save_every_minutes_the_save_period_is_never_touched(algo, monkeypatch):
    clock = Clock(monkeypatch)
    monkeypatch.delenv("NG_SAVE_EVERY_MINUTES", raising=False)
    checkpointing = {"enabled": True, "save_period": 5}
    with StopWatch(algo, checkpointing) as watch:
        timeout = algo.TimeoutChecker(timeout=None, fit_last_save_time=True)
        timeout.start_iterations()
        for _ in range(20):
            clock.advance(3600)
            timeout.mark_iteration()
            assert checkpointing["save_period"] == 5
            timeout.check_save()
    assert watch.periodic_saves == 0


@pytest.mark.nemo_rl
@pytest.mark.v070
def test_every_loop_reads_save_period_before_check_save_and_saves_after_it(nemo_rl_src):
    """What the periodic saves rely on, read from the NeMo-RL in this world (7ea279ab or v0.7.0): in
    each training loop the step's save decision reads ``checkpointing["save_period"]`` before
    ``timeout.check_save()`` (which gives the user's value back), the checkpoint (with the config
    it records) is written after it, and the loop marks iterations (where a save is made due)."""
    import inspect

    from nemo_granular.nemo_rl import compat

    loops = {"grpo": ("grpo_train", "async_grpo_train"), "ppo": ("ppo_train", "async_ppo_train")}
    seen = []
    for module_name, names in loops.items():
        module = compat.module(module_name)
        for name in names:
            fn = getattr(module, name, None)
            if fn is None:
                continue
            src = inspect.getsource(fn)
            decision, check = src.find('checkpointing["save_period"]'), src.find("timeout.check_save()")
            save = src.find("init_tmp_checkpoint(", check)
            assert "timeout.mark_iteration()" in src, name
            assert 0 <= decision < check < save, (name, decision, check, save)
            assert src.count('checkpointing["save_period"]') == 1, name
            seen.append(name)
    assert {"grpo_train", "ppo_train"} <= set(seen), seen
