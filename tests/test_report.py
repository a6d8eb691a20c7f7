"""The comparison report from NeMo-RL run directories (written by NeMo-RL's real Logger) and
embedded ones: canonical metrics, failed/incomplete runs, noise-aware verdicts, the benchmark table."""

from __future__ import annotations

import json
import math
import re
import statistics
from pathlib import Path

import numpy as np
import pytest
import yaml

from nemo_granular.report import load_run, report_from_runs
from nemo_granular.report.stats import (
    FAILS,
    HOLDS,
    INCONCLUSIVE,
    fmt,
    moving_average,
    seed_band,
    verdict_below,
    verdict_greater,
)

STEPS, VAL_PERIOD, PROMPTS, GENS = 20, 5, 4, 8


def _metrics(alg: str, seed: int, step: int) -> dict:
    """Deterministic, algorithm- and seed-dependent values (different per step)."""
    rng = np.random.default_rng(1000 * seed + step + (0 if alg == "grpo" else 7))
    base = {"grpo": 0.30, "sspo": 0.45, "gspo": 0.35}[alg]
    clip = {"grpo": 0.02, "sspo": 0.01, "gspo": 0.002}[alg]
    return {
        "reward": base + 0.01 * step + 0.02 * rng.standard_normal(),
        "clip_frac_low": clip * (1 + 0.1 * rng.random()),
        "clip_frac_high": clip * 0.5,
        "prev_entropy_mean": 0.8 - 0.01 * step * (0.5 if alg == "sspo" else 1.0),
        "mean_gen_tokens_per_sample": 100.0 + step,
        "groups_per_response": {"grpo": 100.0, "sspo": 6.0, "gspo": 1.0}[alg],
        "global_valid_seqs": float(PROMPTS * GENS),
        "loss": 0.1,
        "grad_norm": 1.0,
    }


def _val_acc(alg, seed, step):
    return round(0.2 + 0.01 * step + (0.05 if alg == "sspo" else 0.0) + 0.003 * seed, 6)


def _config(alg: str, seed: int, steps: int) -> dict:
    return {
        "loss_fn": {"granular": {"algorithm": alg}},
        "grpo": {
            "seed": seed,
            "max_num_steps": steps,
            "num_prompts_per_step": PROMPTS,
            "num_generations_per_prompt": GENS,
            "val_period": VAL_PERIOD,
        },
        "policy": {
            "model_name": "Qwen/Qwen2.5-Math-1.5B",
            "optimizer": {"kwargs": {"lr": 1e-6}},
            "generation": {"temperature": 1.0, "top_p": 1.0, "top_k": None, "max_new_tokens": 3072},
        },
        "data": {"train": {"dataset_name": "DAPOMath17K"}},
    }


def _write_nemo_rl_run(run: Path, alg: str, seed: int, steps_logged: int, steps_planned: int = STEPS):
    """A run directory as slurm/submit_comparison.sh lays it out, written by NeMo-RL's Logger."""
    from nemo_rl.utils.logger import Logger, get_next_experiment_dir

    cfg = _config(alg, seed, steps_planned)
    log_dir = get_next_experiment_dir(str(run / "logs"))
    logger = Logger(
        {
            "log_dir": log_dir,
            "wandb_enabled": False,
            "swanlab_enabled": False,
            "tensorboard_enabled": True,
            "mlflow_enabled": False,
            "wandb": {},
            "tensorboard": {},
            "monitor_gpus": False,
            "gpu_monitoring": {"collection_interval": 10, "flush_interval": 10},
        }
    )
    logger.log_hyperparams(cfg)
    times = {}
    for step in range(1, steps_logged + 1):
        if step % VAL_PERIOD == 0:
            logger.log_metrics({"accuracy": _val_acc(alg, seed, step), "avg_length": 99.0}, step, prefix="validation")
            logger.log_metrics({"total_validation_time": 3.0}, step, prefix="timing/validation")
        logger.log_metrics(_metrics(alg, seed, step), step, prefix="train")
        total = 10.0 + step + (3.0 if step % VAL_PERIOD == 0 else 0.0)
        times[step] = total
        logger.log_metrics(
            {"total_step_time": total, "generation": 4.0}, step, prefix="timing/train", step_finished=True
        )
        if step % 10 == 0:
            ck = run / "checkpoints" / f"step_{step}"
            ck.mkdir(parents=True)
            (ck / "config.yaml").write_text(yaml.safe_dump(cfg))
    logger.finish() if hasattr(logger, "finish") else None
    for lg in getattr(logger, "loggers", []):
        if hasattr(lg, "writer"):
            lg.writer.close()
    if steps_logged < 10:  # died before its first checkpoint: the config only in the run directory
        (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    return times


@pytest.fixture(scope="module")
def nemo_runs(tmp_path_factory, nemo_rl_src):
    root = tmp_path_factory.mktemp("cmp")
    runs = {}
    for alg in ("grpo", "sspo"):
        for seed in (0, 1, 2):
            d = root / f"{alg}_seed{seed}"
            runs[(alg, seed)] = (d, _write_nemo_rl_run(d, alg, seed, STEPS))
    # killed at step 7 of 20, its last event record cut short; its Slurm log says why
    cut = root / "gspo_seed0"
    _write_nemo_rl_run(cut, "gspo", 0, 7)
    ev = sorted(cut.rglob("events.out.tfevents.*"), key=lambda p: p.stat().st_size)[-1]
    ev.write_bytes(ev.read_bytes()[:-9])
    (root / "slurm-cmp-gspo_seed0-1234.out").write_text(
        "step 7 done\nslurmstepd: error: *** JOB 1234 ON node1 CANCELLED AT 2026-01-01 DUE TO TIME LIMIT ***\n"
    )
    # never got to log anything
    dead = root / "gspo_seed1"
    (dead / "logs").mkdir(parents=True)
    (dead / "driver.out").write_text("loading\nRuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB\n")
    return root, runs


@pytest.mark.nemo_rl
def test_nemo_rl_run_maps_to_canonical_metrics(nemo_runs):
    root, runs = nemo_runs
    d, times = runs[("sspo", 1)]
    run = load_run(d)
    assert (run.source, run.algorithm, run.seed, run.status) == ("nemo-rl", "sspo", 1, "finished")
    assert [r["step"] for r in run.recs] == list(range(1, STEPS + 1))
    for r in run.recs:
        want = _metrics("sspo", 1, r["step"])
        for key, tag in (
            ("train/reward", "reward"),
            ("train/clip_frac_low", "clip_frac_low"),
            ("train/prev_entropy", "prev_entropy_mean"),
            ("train/response_length", "mean_gen_tokens_per_sample"),
            ("train/groups_per_response", "groups_per_response"),
        ):
            assert r[key] == pytest.approx(want[tag], rel=1e-6)  # TensorBoard stores float32
        assert r["samples"] == r["step"] * PROMPTS * GENS
        # RL wall time: the step times with validation taken out, summed
        naive = sum(times[s] - (3.0 if s % VAL_PERIOD == 0 else 0.0) for s in range(1, r["step"] + 1))
        assert r["wall_time"] == pytest.approx(naive, rel=1e-6)
        assert ("validation/accuracy" in r) == (r["step"] % VAL_PERIOD == 0)
    assert run.meta["model"] == "Qwen/Qwen2.5-Math-1.5B" and run.meta["steps"] == STEPS
    assert run.meta["lr"] == 1e-6 and "4 prompts × 8 samples" == run.meta["batch"]


@pytest.mark.nemo_rl
def test_failed_and_truncated_runs_are_reported_not_fatal(nemo_runs, tmp_path):
    root, runs = nemo_runs
    cut, dead = load_run(root / "gspo_seed0"), load_run(root / "gspo_seed1")
    assert cut.status == "incomplete" and cut.last_step in (6, 7)  # the cut record may be the last step's
    assert "of 20" in cut.problem and "DUE TO TIME LIMIT" in cut.problem
    assert dead.status == "failed" and "no TensorBoard event files" in dead.problem
    assert "CUDA out of memory" in dead.problem
    dirs = sorted(p for p in root.iterdir() if p.is_dir()) + [root / "missing_seed0"]
    report = report_from_runs(dirs, tmp_path / "rep").read_text()
    assert "6 usable of 9" in report
    for name in ("gspo_seed0", "gspo_seed1", "missing_seed0"):
        assert f"`{name}`" in report
    assert "no such directory" in report
    table = [line for line in report.splitlines() if line.startswith("| grpo |") or line.startswith("| sspo |")]
    assert len(table) == 2 and not any(line.startswith("| gspo |") for line in report.splitlines())
    # final validation accuracy, mean ± sd over seeds, computed here from the values logged
    for line in table:
        alg = line.split("|")[1].strip()
        final = [_val_acc(alg, s, STEPS) for s in (0, 1, 2)]
        assert f"{statistics.mean(final):.3f} ± {statistics.stdev(final):.3f}" == line.split("|")[4].strip()
    assert "Qwen/Qwen2.5-Math-1.5B" in report and "arXiv:2511.04256" in report and "4 prompts × 8 samples" in report
    verdicts = {
        line.split("|")[1].strip(): line.split("|")[4].strip()
        for line in report.splitlines()
        if line.startswith("| ") and line.count("|") == 6
    }
    # SSPO's logged accuracy is 0.05 above GRPO's in every seed, its entropy decays at half the rate
    assert verdicts["SSPO reaches a higher final validation accuracy than GRPO"] == HOLDS
    assert verdicts["π_old entropy decays slower for SSPO than for GRPO (last/first tenth)"] == HOLDS
    # its runs were left out: no row (no interval), named under the table instead
    assert "GSPO's clip fraction is near zero (< 1 %)" not in verdicts
    unmeasured = next(line for line in report.splitlines() if line.startswith("Not measured here"))
    assert "GSPO's clip fraction is near zero (< 1 %) (SSPO §1)" in unmeasured, unmeasured
    assert all(v != "n/a (not run)" for v in verdicts.values()), verdicts
    for png in ("reward_vs_step.png", "accuracy_vs_step.png", "reward_vs_wall_time.png"):
        assert (tmp_path / "rep" / png).is_file()


@pytest.mark.nemo_rl
def test_compare_from_runs_cli_reads_nemo_rl_runs(nemo_runs, tmp_path):
    from nemo_granular.cli import main

    root, runs = nemo_runs
    out = tmp_path / "cli"
    assert (
        main(
            [
                "compare",
                "--from-runs",
                str(runs[("grpo", 0)][0]),
                str(runs[("sspo", 0)][0]),
                str(root / "gspo_seed1"),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    report = (out / "report.md").read_text()
    assert "2 usable of 3" in report and "inconclusive (1 seed)" in report
    assert "± 0.000" not in report  # one seed: no spread shown as zero
    assert main(["compare", "--from-runs", str(root / "gspo_seed1"), "--out", str(tmp_path / "none")]) == 2


def test_verdicts_follow_the_noise_threshold():
    assert verdict_greater([0.10, 0.12, 0.11])[0] == HOLDS
    assert verdict_greater([-0.10, -0.12, -0.11])[0] == FAILS
    assert verdict_greater([0.10, -0.08, 0.02])[0] == INCONCLUSIVE  # mean 0.013 < sd 0.09
    assert verdict_greater([0.5])[0].startswith(INCONCLUSIVE) and "(1 seed)" in verdict_greater([0.5])[0]
    assert verdict_below([0.001, 0.002, 0.0015], 0.01)[0] == HOLDS
    assert verdict_below([0.2, 0.3, 0.25], 0.01)[0] == FAILS
    assert verdict_below([0.0, 0.02, 0.01], 0.01)[0] == INCONCLUSIVE
    assert fmt(0.5, None, 1) == "0.500" and fmt(0.5, 0.01, 3) == "0.500 ± 0.010"


def test_smoothing_and_band_against_naive_loops():
    rng = np.random.default_rng(0)
    y = rng.standard_normal(37)
    for w in (1, 3, 10):
        naive = [float(np.mean(y[max(0, i - w + 1) : i + 1])) for i in range(len(y))]
        np.testing.assert_allclose(moving_average(y, w), naive, rtol=0, atol=1e-12)
    curves = [(np.arange(0, 11.0), np.arange(0, 11.0) * k) for k in (1.0, 2.0, 3.0)]
    grid, mean, lo, hi = seed_band(curves, grid_points=11)
    np.testing.assert_allclose(mean, grid * 2.0)
    np.testing.assert_allclose(lo, grid) and np.testing.assert_allclose(hi, grid * 3.0)


# ---------------------------------------------------------------------------- embedded runs + evals.json
def _embedded_run(
    root: Path,
    alg: str,
    seed: int,
    accs: list[float],
    steps: int = 20,
    suite_scores=None,
    clip: float = 0.01,
    per_step=None,
) -> Path:
    run = root / f"{alg}_seed{seed}"
    run.mkdir(parents=True)
    cfg = {
        "name": alg,
        "seed": seed,
        "loss_fn": {"granular": {"algorithm": alg}},
        "model": {"hidden_size": 64, "num_layers": 2},
        "task": {"kind": "arithmetic", "num_terms": 4, "max_term": 9},
        "rl": {
            "steps": steps,
            "prompts_per_step": 16,
            "generations_per_prompt": 8,
            "lr": 1e-4,
            "temperature": 1.0,
            "max_new_tokens": 32,
            "eval_every": 10,
            "minibatches_per_rollout": 4,
        },
    }
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    recs = [{"step": 0, "samples": 0, "wall_time": 0.0, "validation/accuracy": accs[0]}]
    for s in range(1, steps + 1):
        rec = {
            "step": s,
            "samples": 128 * s,
            "wall_time": 1.5 * s,
            "train/reward": 0.4 + 0.01 * s + 0.001 * seed,
            "train/clip_frac_low": clip * (1 + 0.2 * math.sin(s)),
            "train/clip_frac_high": clip / 2,
            "train/prev_entropy": 0.5 - 0.01 * s,
            "train/response_length": 27.0,
            "train/groups_per_response": 4.0,
        }
        rec.update(per_step(s) if per_step else {})
        if s % 10 == 0:
            rec["validation/accuracy"] = accs[s // 10]
        recs.append(rec)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    if suite_scores:
        from nemo_granular.evals.results import merge_write

        merge_write(
            run / "evals.json",
            run.name,
            "embedded",
            "sspo",
            {"description": "SSPO protocol", "select": "best", "select_note": "best"},
            {
                "sum3": {
                    "label": "sum3",
                    "problems": 64,
                    "samples_per_problem": 1,
                    "decoding": "greedy",
                    "metric": "avg@1",
                },
                "sum5": {
                    "label": "sum5",
                    "problems": 64,
                    "samples_per_problem": 1,
                    "decoding": "greedy",
                    "metric": "avg@1",
                },
            },
            suite_scores,
        )
    return run


def test_benchmark_table_reports_the_best_checkpoint(tmp_path):
    a = _embedded_run(
        tmp_path,
        "grpo",
        0,
        [0.5, 0.6, 0.7],
        suite_scores={0: {"sum3": 0.1, "sum5": 0.0}, 10: {"sum3": 0.4, "sum5": 0.2}, 20: {"sum3": 0.3, "sum5": 0.1}},
    )
    b = _embedded_run(
        tmp_path,
        "grpo",
        1,
        [0.5, 0.65, 0.75],
        suite_scores={0: {"sum3": 0.1, "sum5": 0.0}, 10: {"sum3": 0.2, "sum5": 0.1}, 20: {"sum3": 0.5, "sum5": 0.3}},
    )
    c = _embedded_run(tmp_path, "sspo", 0, [0.5, 0.7, 0.8])  # no evals: a row of n/a is not invented
    report = report_from_runs([a, b, c], tmp_path / "rep").read_text()
    row = next(
        line
        for line in report.splitlines()
        if line.startswith("| grpo | 2 | 0.") and "avg" not in line and line.count("|") == 7
    )
    cells = [x.strip() for x in row.split("|")[1:-1]]
    # seed 0: best average at step 10 (0.3), seed 1: at step 20 (0.4)
    assert cells[2] == fmt(statistics.mean([0.4, 0.5]), statistics.stdev([0.4, 0.5]), 2)
    assert cells[4] == fmt(statistics.mean([0.3, 0.4]), statistics.stdev([0.3, 0.4]), 2)
    assert cells[5] == "10, 20"
    assert "Suite `sspo`" in report and "tiny random Qwen3" in report and "synthetic sums of 4 integers" in report
    assert not any(line.startswith("| sspo | 1 | 0.") and line.count("|") == 7 for line in report.splitlines())


def test_incomplete_embedded_run_is_listed(tmp_path):
    a = _embedded_run(tmp_path, "grpo", 0, [0.5, 0.6, 0.7])
    b = _embedded_run(tmp_path, "gspo", 0, [0.5, 0.6, 0.7])
    lines = (b / "metrics.jsonl").read_text().splitlines()[:8]
    (b / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 8, "samp')  # killed mid-line
    (b / "train.log").write_text("step 7\nValueError: non-finite loss at step 8\n")
    report = report_from_runs([a, b], tmp_path / "rep").read_text()
    assert "`gspo_seed0` (embedded, incomplete): stopped at step 7 of 20" in report
    assert "non-finite loss" in report and math.isfinite(len(report))


def _suite(run: Path, suite: str, description: str, samples: int, scores: dict, note: str) -> None:
    from nemo_granular.evals.results import merge_write

    bench = {
        k: {
            "label": k,
            "problems": 64,
            "samples_per_problem": samples,
            "decoding": "T=0.6, top-p 1",
            "metric": f"avg@{samples}",
        }
        for k in ("sum3", "sum5")
    }
    merge_write(
        run / "evals.json",
        run.name,
        "embedded",
        suite,
        {"description": description, "select": "last", "select_note": note},
        bench,
        scores,
    )


def test_suites_that_measure_the_same_thing_here_are_one_table_that_says_so(tmp_path):
    """Capped at 8 samples per problem, the SPPO (avg@16) and ESPO (avg@32) protocols are one measurement:
    the report says so once, with what was measured, instead of two identical tables under headings
    that claim avg@16 and avg@32."""
    runs = []
    for alg, seed in (("grpo", 0), ("sspo", 0)):
        run = _embedded_run(tmp_path, alg, seed, [0.5, 0.6, 0.7])
        scores = {0: {"sum3": 0.25, "sum5": 0.125}, 20: {"sum3": 0.5 if alg == "grpo" else 0.625, "sum5": 0.25}}
        _suite(run, "sppo", "SPPO §4.1: avg@16 at temperature 0.6, final checkpoint", 8, scores, "the last")
        _suite(run, "espo", "ESPO Table 1: AIME/HMMT avg@32, final checkpoint", 8, scores, "the last; T=0.6 here")
        runs.append(run)
    report = report_from_runs(runs, tmp_path / "rep").read_text()
    bench = report.split("## Benchmark suite")[1].split("## The papers")[0]
    assert bench.count("| grpo | 1 |") == 1 and bench.count("| sspo | 1 |") == 1, bench  # one table, not two
    assert "### Suites `sppo` and `espo`: one measurement here" in bench, bench
    assert "avg@8" in bench.split("| benchmark |")[0]  # said before the table: what was measured
    for claim in ("SPPO §4.1: avg@16", "ESPO Table 1: AIME/HMMT avg@32"):  # each protocol still named
        assert claim in bench
    # a suite that differs (other samples) keeps its own table
    for run in runs:
        _suite(
            run,
            "espo",
            "ESPO Table 1: AIME/HMMT avg@32, final checkpoint",
            32,
            {0: {"sum3": 0.5, "sum5": 0.5}, 20: {"sum3": 0.5, "sum5": 0.5}},
            "the last",
        )
    bench = report_from_runs(runs, tmp_path / "rep2").read_text().split("## Benchmark suite")[1]
    assert "### Suite `sppo`" in bench and "### Suite `espo`" in bench and "one measurement here" not in bench


def test_an_absolute_claim_is_judged_on_one_seed_against_the_runs_own_spread(tmp_path):
    """'GSPO's clip fraction is near zero (< 1 %)' is a claim about one number, not a comparison: one seed
    measuring 22.6 % refutes it; one seed clearly below 1 % supports it (noise: the step-to-step spread)."""
    from nemo_granular.report.stats import verdict_below

    assert verdict_below([0.226], 0.01, within=[0.20, 0.25, 0.22, 0.23])[0] == FAILS
    assert verdict_below([0.002], 0.01, within=[0.001, 0.003, 0.002])[0] == HOLDS
    assert verdict_below([0.009], 0.01, within=[0.0, 0.018])[0].startswith(INCONCLUSIVE)  # within the spread
    assert verdict_below([0.009], 0.01)[0].startswith(INCONCLUSIVE)  # nothing to judge the noise by

    def verdict(clip, name):
        run = _embedded_run(tmp_path / name, "gspo", 0, [0.5, 0.6, 0.7], clip=clip)
        report = report_from_runs([run], tmp_path / name / "rep").read_text()
        row = next(line for line in report.splitlines() if line.startswith("| GSPO's clip fraction is near zero"))
        return row.split("|")[4].strip(), row.split("|")[5].strip()

    high, note = verdict(0.15, "high")  # ≈ 22.5 % clipped per step
    assert high == FAILS and "1 seed" in note and "step-to-step" in note, note
    assert verdict(0.002, "low")[0] == HOLDS


def _timed(t0: float, cpu_per_s: float = 0.97):
    """Per-step timing as the embedded trainer records it: 1.5 s steps ending at t0 + 1.5·s (and a flat
    reward, so that every run reaches GRPO's final reward and the wall-time claim has a measurement)."""
    return lambda s: {
        "timing/train/total_step_time": 1.5,
        "timing/train/cpu_time": 1.5 * cpu_per_s,
        "timing/train/step_end_unix": t0 + 1.5 * s,
        "train/reward": 0.5,
    }


def _wall_verdict(report: str, setting: str = "equal samples") -> tuple[str, str]:
    row = next(
        line
        for line in report.splitlines()
        if line.startswith("| SPPO reaches GRPO's final reward sooner") and setting in line
    )
    return row.split("|")[4].strip(), row.split("|")[5].strip()


def test_sppo_speed_claim_is_judged_on_cpu_time_whatever_the_runs_shared(tmp_path):
    """The demo's 5 runs, 2 at a time: GRPO trains beside GSPO, SPPO trains last, alone, so their wall
    times do not compare. Their CPU seconds do (one thread per run): the claim is judged on those, and
    says so; runs without CPU records (NeMo-RL) are judged on wall time and the note says that."""

    def runs(root, sppo_t0, sppo_cpu=0.97, sppo_reward=0.5):
        sppo = _timed(sppo_t0, sppo_cpu)
        return [
            _embedded_run(root, "grpo", 0, [0.5, 0.6, 0.7], per_step=_timed(1000.0)),
            _embedded_run(root, "gspo", 0, [0.5, 0.6, 0.7], per_step=_timed(1000.5)),
            _embedded_run(
                root, "sppo", 0, [0.5, 0.6, 0.7], per_step=lambda s: {**sppo(s), "train/reward": sppo_reward}
            ),
        ]

    alone = report_from_runs(runs(tmp_path / "a", sppo_t0=5000.0), tmp_path / "a" / "rep").read_text()
    verdict, note = _wall_verdict(alone)
    assert verdict.startswith(INCONCLUSIVE) and "(1 seed)" in verdict, (verdict, note)  # one seed: no interval
    assert "in CPU s" in note, note
    row = next(line for line in alone.splitlines() if line.startswith("| SPPO reaches GRPO's final reward sooner"))
    # both reach the flat reward at the 10th step (the trailing 10-step mean): 10 × 1.5 s × 0.97 CPU s/s
    assert "GRPO 14.6 CPU s, SPPO 14.6 CPU s" in row, row

    # SPPO got half the CPU per wall second (another job): the same CPU seconds, the same measurement
    starved = report_from_runs(runs(tmp_path / "c", 1000.2, sppo_cpu=0.45), tmp_path / "c" / "rep").read_text()
    row = next(line for line in starved.splitlines() if line.startswith("| SPPO reaches GRPO's final reward sooner"))
    assert "GRPO 14.6 CPU s, SPPO 6.75 CPU s" in row, row  # 10 × 1.5 × 0.45

    # runs that recorded no timing (older runs, NeMo-RL runs): wall time, and the note says so
    flat = lambda s: {"train/reward": 0.5}  # noqa: E731
    plain = [_embedded_run(tmp_path / "d", a, 0, [0.5, 0.6, 0.7], per_step=flat) for a in ("grpo", "sppo")]
    verdict, note = _wall_verdict(report_from_runs(plain, tmp_path / "d" / "rep").read_text())
    assert verdict.startswith(INCONCLUSIVE) and "CPU sharing not recorded" in note and "s wall" in note


def _t_quantile_by_integration(df: int, p: float = 0.975) -> float:
    """Student's t quantile from its density (log-gamma normaliser, Simpson's rule, bisection)."""
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)

    n = 400
    simpson = np.where(np.arange(n + 1) % 2 == 1, 4.0, 2.0)
    simpson[0] = simpson[-1] = 1.0

    def cdf(x):  # 0.5 + ∫_0^x f, Simpson's rule on n intervals
        t = np.linspace(0.0, x, n + 1)
        return 0.5 + float((simpson * c * (1 + t**2 / df) ** (-(df + 1) / 2)).sum()) * (x / n) / 3

    lo, hi = 0.0, 20.0
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < p else (lo, mid)
    return (lo + hi) / 2


def test_t_quantiles_against_the_t_density():
    from nemo_granular.report.stats import t975

    for df in (*range(1, 31), 31, 35, 40, 60, 120):
        exact = _t_quantile_by_integration(df)
        assert abs(t975(df) - exact) < 1e-3 * (1 + (df == 1) * 4), (df, t975(df), exact)


def test_verdicts_are_judged_on_the_interval_and_show_it():
    from nemo_granular.report.stats import mean_ci

    diffs = [0.3, 0.05, 0.1]  # mean 0.15 > sd 0.13, but with 3 seeds the 95 % interval contains 0
    verdict, note = verdict_greater(diffs)
    mu, sd = statistics.mean(diffs), statistics.stdev(diffs)
    half = _t_quantile_by_integration(2) * sd / math.sqrt(3)
    assert verdict == INCONCLUSIVE, (verdict, note)
    assert f"95 % CI [{mu - half:+.3g}, {mu + half:+.3g}]" in note, note
    m, lo, hi, n = mean_ci(diffs)
    assert n == 3 and abs(m - mu) < 1e-12 and abs(lo - (mu - half)) < 1e-3 and abs(hi - (mu + half)) < 1e-3
    assert verdict_greater([0.3, 0.25, 0.28])[0] == HOLDS  # a consistent effect: the interval excludes 0
    assert verdict_below([0.008, 0.002, 0.004], 0.01)[0] == INCONCLUSIVE  # mean + sd < 0.01, interval is not


def test_report_shows_each_clip_range_and_says_how_plots_are_smoothed(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    titles, outside = {}, {}
    real_savefig = Figure.savefig

    def savefig(fig, path, **kw):
        ax = fig.axes[0]
        fig.canvas.draw()
        legend = ax.get_legend().get_window_extent()
        outside[ax.get_title()] = legend.x0 >= ax.get_window_extent().x1  # the legend right of the axes
        return real_savefig(fig, path, **kw)

    real_title = Axes.set_title
    monkeypatch.setattr(
        Axes, "set_title", lambda ax, t, **kw: (titles.setdefault(t.split("\n")[0], t), real_title(ax, t, **kw))[1]
    )
    monkeypatch.setattr(Figure, "savefig", savefig)
    bounds = {"grpo": (0.8, 1.2), "gspo": (0.9997, 1.0004)}
    runs = [
        _embedded_run(
            tmp_path,
            alg,
            seed,
            [0.5, 0.6, 0.7],
            per_step=lambda s, b=bounds[alg]: {
                "train/clip_bound_low_mean": b[0] - 0.001 * (s % 2),
                "train/clip_bound_high_mean": b[1],
            },
        )
        for alg in bounds
        for seed in (0, 1)
    ]
    report = report_from_runs(runs, tmp_path / "rep").read_text()
    rows = {
        line.split("|")[1].strip(): line
        for line in report.splitlines()
        if line.startswith("| grpo |") or line.startswith("| gspo |")
    }
    # mean over steps: half the steps 0.001 lower
    assert "| [0.79950, 1.20000] |" in rows["grpo"], rows["grpo"]
    assert "| [0.99920, 1.00040] |" in rows["gspo"], rows["gspo"]
    gs_claim = next(line for line in report.splitlines() if line.startswith("| GSPO's clip fraction is near zero"))
    assert "range [0.99920, 1.00040]" in gs_claim, gs_claim
    # 20 steps: the reward is a trailing mean over 2 steps; the 3 held-out evaluations are not smoothed
    assert "trailing mean over 2 RL steps" in titles["reward (sampled, training)"], titles
    assert "not smoothed" in titles["held-out validation accuracy"], titles
    assert "smoothed" not in titles["held-out validation accuracy"].replace("not smoothed", ""), titles
    assert outside and all(outside.values()), outside


# ---------------------------------------------------------------------------- warm starts, smoke runs
def _warm_start_dir(root: Path, seed: int, accuracy: float, steps: int, target: float, max_steps: int) -> Path:
    """A warm start's folder as ``compare`` writes it: config.yaml and the step-0 record (warmstart/*)."""
    ws = root / "warmstart" / f"seed{seed}-{seed:016x}"
    ws.mkdir(parents=True)
    (ws / "config.yaml").write_text(
        yaml.safe_dump({"seed": seed, "warmstart": {"target_accuracy": target, "max_steps": max_steps}})
    )
    (ws / "metrics.jsonl").write_text(
        json.dumps(
            {
                "step": 0,
                "validation/accuracy": accuracy,
                "warmstart/steps": steps,
                "warmstart/accuracy": accuracy,
                "warmstart/seconds": 9.0,
            }
        )
        + "\n"
    )
    return ws


def test_warm_starts_against_their_targets_and_a_smoke_report(tmp_path):
    """Each warm start the runs started from (model.init_from) is stated against its target, a missed one at
    the top; a smoke report says so at its top and judges no claim, while the same runs otherwise get verdicts."""
    missed = _warm_start_dir(tmp_path, 0, 0.195, 150, 0.5, 150)
    reached = _warm_start_dir(tmp_path, 1, 0.5, 75, 0.5, 150)  # exactly the target: reached
    runs = []
    for seed, ws in ((0, missed), (1, reached)):
        for alg, clip in (("grpo", 0.02), ("gspo", 0.001)):
            run = _embedded_run(tmp_path / "runs", alg, seed, [0.3, 0.4 + 0.01 * seed, 0.5], clip=clip)
            cfg = yaml.safe_load((run / "config.yaml").read_text())
            cfg["model"]["init_from"] = str(ws / "checkpoints" / "step_000000" / "policy")
            (run / "config.yaml").write_text(yaml.safe_dump(cfg))
            runs.append(run)
    smoke = report_from_runs(runs, tmp_path / "smoke", smoke=True).read_text()
    full = report_from_runs(runs, tmp_path / "full").read_text()
    for report in (smoke, full):
        top, setting = report.split("## Setting")
        assert (
            "**1 of 2 warm starts missed their target**" in top
            and f"seed 0 (`{missed.name}`) reached 0.195 < target 0.5 after 150 steps (warmstart.max_steps=150)" in top
        )
        assert reached.name not in top
        assert (
            f"seed 0 (`{missed.name}`): 0.195 after 150 steps, target 0.5: **missed**; "
            f"seed 1 (`{reached.name}`): 0.500 after 75 steps, target 0.5: reached"
        ) in setting
    assert smoke.startswith("# nemo-granular comparison (smoke run)\n\n> **Smoke run**")
    assert "Smoke run" not in full and "not judged" not in full
    verdicts = {
        r: [
            line.split("|")[4].strip()
            for line in r.split("## The papers")[1].splitlines()
            if line.startswith("| ") and not line.startswith("| claim")
        ]
        for r in (smoke, full)
    }
    assert verdicts[smoke] and set(verdicts[smoke]) == {"not judged: smoke run"}
    assert len(verdicts[full]) == len(verdicts[smoke])
    assert all(v.startswith((HOLDS, FAILS, INCONCLUSIVE)) for v in verdicts[full]), verdicts[full]
    assert HOLDS in verdicts[full]  # GSPO's clip fraction 0.001 < 1 %, in both seeds
    assert f"| {HOLDS} |" not in smoke and FAILS not in smoke and INCONCLUSIVE not in smoke


# ---------------------------------------------------------------------------- what the plots draw (issue #36, item 8)
@pytest.fixture
def saved_figures(monkeypatch):
    """file name → what its figure drew, read from the figure as it is saved: the labelled (bold)
    lines' (label, colour, x, y), the band polygons' x, the legend texts, every text on the axes."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.colors import to_hex
    from matplotlib.figure import Figure

    drawn, real_savefig = {}, Figure.savefig

    def savefig(fig, path, **kw):
        ax = fig.axes[0]
        legend = ax.get_legend()
        # report/build.py's _save writes nemo_granular.atomic's temporary name: .<stem>.tmp-<host>-<pid><suffix>
        drawn[re.sub(r"^\.(.*?)\.tmp-.*-\d+(\.[^.]+)$", r"\1\2", Path(path).name)] = {
            "lines": [
                (
                    ln.get_label(),
                    to_hex(ln.get_color()),
                    np.asarray(ln.get_xdata(), float),
                    np.asarray(ln.get_ydata(), float),
                )
                for ln in ax.lines
                if not ln.get_label().startswith("_")
            ],
            "n_lines": len(ax.lines),
            "band_x": [p.vertices[:, 0] for c in ax.collections for p in c.get_paths()],
            "legend": [t.get_text() for t in legend.get_texts()] if legend else [],
            "texts": [t.get_text() for t in ax.texts] + [ax.get_title()],
        }
        return real_savefig(fig, path, **kw)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return drawn


def test_no_mismatch_is_said_not_plotted_as_float_noise(tmp_path, saved_figures):
    noise = {0: 1e-7, 1: 2.5e-7}  # π_old vs π_gen equal up to float32 rounding: no mismatch
    runs = [
        _embedded_run(
            tmp_path / "a",
            "grpo",
            seed,
            [0.5, 0.6, 0.7],
            per_step=lambda s, m=noise[seed]: {"train/gen_mismatch_abs_mean": m * (s % 3)},
        )
        for seed in noise
    ]
    report = report_from_runs(runs, tmp_path / "rep_a").read_text()
    panel = saved_figures["gen_mismatch_abs_mean_vs_step.png"]
    assert panel["n_lines"] == 0 and not panel["band_x"], panel  # no curve, so no 1e-7 ticks
    biggest = max(noise.values()) * 2  # s % 3 == 2
    assert any(f"no mismatch (max |x| = {biggest:.1e}" in t for t in panel["texts"]), panel["texts"]
    assert f"no mismatch (max |x| = {biggest:.1e}" in report
    # a real mismatch is still drawn
    saved_figures.clear()
    real = [
        _embedded_run(
            tmp_path / "b", "grpo", 0, [0.5, 0.6, 0.7], per_step=lambda s: {"train/gen_mismatch_abs_mean": 1e-3 * s}
        )
    ]
    report_from_runs(real, tmp_path / "rep_b")
    assert saved_figures["gen_mismatch_abs_mean_vs_step.png"]["lines"]


def test_a_mean_that_stops_at_the_shortest_seed_says_so(tmp_path, saved_figures):
    per_s = {0: 1.5, 1: 2.0, 2: 2.5}  # RL wall seconds per step: the seeds end at 30, 40 and 50 s
    runs = [
        _embedded_run(tmp_path, "grpo", seed, [0.5, 0.6, 0.7], per_step=lambda s, k=per_s[seed]: {"wall_time": k * s})
        for seed in per_s
    ]
    report_from_runs(runs, tmp_path / "rep")
    shortest = min(
        json.loads(line)["wall_time"] for r in runs for line in (r / "metrics.jsonl").read_text().splitlines()[-1:]
    )
    ((label, _, xs, _),) = saved_figures["reward_vs_wall_time.png"]["lines"]
    assert xs.max() == pytest.approx(shortest)
    assert label == f"grpo (3 seeds;\nbold: mean of all 3 up to\n{shortest:g} s, where the shortest ends)", label
    # every seed reaches step 20: nothing to say there
    ((label, _, xs, _),) = saved_figures["reward_vs_step.png"]["lines"]
    assert label == "grpo (3 seeds)" and xs.max() == 20


def test_clip_curves_are_straight_between_steps(tmp_path, saved_figures):
    runs = [
        _embedded_run(tmp_path, alg, seed, [0.5, 0.6, 0.7], clip=0.01 * (seed + 1))
        for alg in ("grpo", "gspo")
        for seed in (0, 1)
    ]
    report_from_runs(runs, tmp_path / "rep")
    steps = set(range(1, 21))
    for name in ("clip_frac_low_vs_step.png", "clip_frac_high_vs_step.png"):
        panel = saved_figures[name]
        # a vertex between two steps is what a symlog axis bends into an arc: every vertex is a step
        for label, _, xs, _ys in panel["lines"]:
            assert set(xs.tolist()) <= steps, (name, label, xs[:5])
        for xs in panel["band_x"]:
            assert set(np.round(xs, 9).tolist()) <= steps, (name, xs[:5])
    # the bold low-side curve: the mean over seeds of each seed's trailing mean over 2 steps, at each step
    (_, _, xs, ys), _ = saved_figures["clip_frac_low_vs_step.png"]["lines"]
    per_seed = [
        [json.loads(line)["train/clip_frac_low"] for line in (r / "metrics.jsonl").read_text().splitlines()[1:]]
        for r in runs[:2]
    ]
    trailing = [[statistics.mean(c[max(0, i - 1) : i + 1]) for i in range(len(c))] for c in per_seed]
    np.testing.assert_allclose(ys, [statistics.mean(v) for v in zip(*trailing)], rtol=1e-12)


def test_an_algorithm_keeps_its_colour_whichever_others_are_in_the_report(tmp_path, saved_figures):
    colours = []
    for i, algs in enumerate((("grpo", "sspo"), ("gspo", "espo", "sspo"))):
        runs = [_embedded_run(tmp_path / str(i), alg, 0, [0.5, 0.6, 0.7]) for alg in algs]
        saved_figures.clear()
        report_from_runs(runs, tmp_path / f"rep{i}")
        by_label = {}
        for panel in saved_figures.values():
            for label, colour, _, _ in panel["lines"]:
                by_label.setdefault(label.split(" ")[0], set()).add(colour)
        assert all(len(c) == 1 for c in by_label.values()), by_label  # one colour in every plot
        assert len({next(iter(c)) for c in by_label.values()}) == len(algs), by_label  # distinct in a report
        colours.append({alg: c.pop() for alg, c in by_label.items()})
    assert colours[0]["sspo"] == colours[1]["sspo"], colours
