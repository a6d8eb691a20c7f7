"""The papers' benchmark suites: the exact run_eval commands per checkpoint, the configs against
NeMo-RL's eval schema and dataset loader, a shimmed end-to-end eval-checkpoints → evals.json →
report, and the embedded mechanics (synthetic levels, avg@k scoring). Nothing downloads."""

from __future__ import annotations

import json
import os
import re
import shlex
import statistics
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from nemo_granular.evals import nemo_rl as ev
from nemo_granular.evals.embedded import read_benchmark, score, write_synthetic_benchmarks
from nemo_granular.evals.results import select_checkpoint
from nemo_granular.evals.suite import BENCHMARKS, PROTOCOLS, Setting, protocols_for

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "nemo_granular" / "configs" / "evals"  # package data


def _fake_run(tmp_path: Path, steps=(10, 20, 25), hf=()) -> Path:
    run = tmp_path / "espo_seed0"
    for s in steps:
        (run / "checkpoints" / f"step_{s}" / "policy").mkdir(parents=True)
    for s in hf:
        (run / "hf" / f"step_{s}").mkdir(parents=True)
        (run / "hf" / f"step_{s}" / "config.json").write_text("{}")
    return run


def _data_dir(tmp_path: Path, keys=None, n=3) -> Path:
    d = tmp_path / "data"
    d.mkdir(exist_ok=True)
    for k in keys or BENCHMARKS:
        (d / f"{k}.jsonl").write_text(
            "".join(
                json.dumps({"problem": f"{k} problem {i}: 2+{i}?", "answer": str(2 + i)}) + "\n"
                for i in range(n + len(k) % 3)
            )
        )
    return d


# ---------------------------------------------------------------------------- the plan
def test_plan_sspo_every_10_steps_exact_commands(tmp_path):
    run = _fake_run(tmp_path, hf=(20,))
    data = _data_dir(tmp_path, ["amc23", "minerva_math", "olympiadbench"])
    cmds = ev.plan(
        run, protocols_for("sspo"), nemo_rl_dir=tmp_path / "nemo-rl", data_dir=data, python="PY", gpus_per_node=4
    )
    # steps 10 and 20 (multiples of 10) and the last, 25; export only where hf/step_N is missing
    assert [(c.kind, c.step) for c in cmds if c.kind == "export"] == [("export", 10), ("export", 25)]
    assert cmds[0].argv == [
        "PY",
        "-m",
        "nemo_granular",
        "export",
        str(run.resolve() / "checkpoints" / "step_10"),
        str(run.resolve() / "hf" / "step_10"),
        "--no-verify",
    ]
    evals = [c for c in cmds if c.kind == "eval"]
    assert sorted({c.step for c in evals}) == [10, 20, 25]
    assert {c.benchmark for c in evals} == {"math500", "amc23", "aime24", "minerva_math", "olympiadbench"}
    math500 = next(c for c in evals if c.step == 10 and c.benchmark == "math500")
    hf = run.resolve() / "hf" / "step_10"
    assert math500.argv == [
        "uv",
        "run",
        "python",
        "examples/run_eval.py",
        "--config",
        str(CONFIGS / "math500.yaml"),
        f"generation.model_name={hf}",
        f"tokenizer.name={hf}",
        "eval.metric=pass@k",
        "eval.k_value=1",
        "eval.num_tests_per_prompt=1",
        "generation.temperature=0",
        "generation.top_p=1",
        "generation.vllm_cfg.max_model_len=4096",
        "generation.vllm_cfg.tensor_parallel_size=1",
        "cluster.gpus_per_node=4",
        "cluster.num_nodes=1",
        f"eval.save_path={run.resolve() / 'evals' / 'sspo' / 'step_10' / 'math500'}",
    ]
    assert math500.cwd == tmp_path / "nemo-rl"
    amc = next(c for c in evals if c.step == 20 and c.benchmark == "amc23")
    assert f"data.dataset_name={data.resolve() / 'amc23.jsonl'}" in amc.argv
    assert "data.problem_key=problem" in amc.argv and "data.solution_key=answer" in amc.argv


def test_plan_sppo_espo_settings_and_last_checkpoint(tmp_path):
    run = _fake_run(tmp_path)
    data = _data_dir(tmp_path)
    cmds = ev.plan(run, protocols_for("all"), nemo_rl_dir=tmp_path, data_dir=data, launcher="python run_eval.py")
    exports = [c.step for c in cmds if c.kind == "export"]
    assert exports == [10, 20, 25]  # once per step although three suites use step 25... and 10/20 for sspo
    for suite, n, temp in (("sppo", 16, "0.6"), ("espo", 32, "0.6")):
        mine = [c for c in cmds if c.suite == suite]
        assert {c.step for c in mine} == {25}
        for c in mine:
            want_n = 1 if (suite, c.benchmark) == ("espo", "math500") else n
            assert f"eval.num_tests_per_prompt={want_n}" in c.argv
            assert f"generation.temperature={'0' if want_n == 1 else temp}" in c.argv
            assert "generation.vllm_cfg.max_model_len=9216" in c.argv
            assert c.argv[:2] == ["python", "run_eval.py"]
    assert {c.benchmark for c in cmds if c.suite == "espo"} == {"aime24", "aime25", "math500", "hmmt25"}
    # a local file replaces NeMo-RL's own loader (offline nodes)
    aime = next(c for c in cmds if c.suite == "sppo" and c.benchmark == "aime24")
    assert f"data.dataset_name={data.resolve() / 'aime24.jsonl'}" in aime.argv


def test_plan_sizes_vllm_tp_from_the_training_run(tmp_path):
    """Issue 24.9: the eval's vLLM tensor_parallel_size is the training run's (the ``config.yaml``
    NeMo-RL saves in each checkpoint), not 1: Qwen3-30B-A3B's bf16 weights (~57 GiB) leave little
    of an H100's 80 GB for the KV cache at TP 1. The shipped 30B configs' value is read
    from the file; an explicit --tensor-parallel wins; a TP larger than the eval's GPUs is refused."""
    shipped = yaml.safe_load((ROOT / "examples" / "configs" / "espo_qwen3_30b_a3b_megatron.yaml").read_text())
    want = shipped["policy"]["generation"]["vllm_cfg"]["tensor_parallel_size"]
    assert want > 1
    run = _fake_run(tmp_path, steps=(10, 20), hf=(10, 20))
    (run / "checkpoints" / "step_20" / "config.yaml").write_text(yaml.safe_dump(shipped))
    espo = protocols_for("espo")
    cmds = ev.plan(run, espo, nemo_rl_dir=tmp_path, data_dir=_data_dir(tmp_path), gpus_per_node=8)

    def tps(cmds):
        return {
            (c.step, c.benchmark): next(a for a in c.argv if "tensor_parallel_size" in a).split("=")[1]
            for c in cmds
            if c.kind == "eval"
        }

    assert set(tps(cmds).values()) == {str(want)}  # espo: the last checkpoint, step 20
    every = ev.plan(run, espo, nemo_rl_dir=tmp_path, data_dir=_data_dir(tmp_path), steps=[10, 20])
    assert {s: v for (s, _), v in tps(every).items()} == {10: "1", 20: str(want)}  # step 10: no config.yaml
    forced = ev.plan(run, espo, nemo_rl_dir=tmp_path, data_dir=_data_dir(tmp_path), tensor_parallel=2)
    assert set(tps(forced).values()) == {"2"}
    with pytest.raises(
        ValueError,
        match=rf"tensor_parallel_size {want} \(the run's policy.generation.vllm_cfg\) "
        r"needs more GPUs than the eval has \(1 node\(s\) x 2\)",
    ):
        ev.plan(run, espo, nemo_rl_dir=tmp_path, data_dir=_data_dir(tmp_path), gpus_per_node=2)


def test_plan_errors_name_the_problem(tmp_path):
    run = _fake_run(tmp_path)
    with pytest.raises(ValueError, match="benchmark amc23: NeMo-RL has no loader.*--data-dir"):
        ev.plan(run, protocols_for("sspo"), nemo_rl_dir=tmp_path)
    cmds = ev.plan(
        run, protocols_for("sppo"), nemo_rl_dir=tmp_path, data_dir=_data_dir(tmp_path, ["amc23", "minerva_math"])
    )
    aime = next(c for c in cmds if c.benchmark == "aime24")
    assert not any(a.startswith("data.") for a in aime.argv)  # NeMo-RL's AIME2024 loader
    with pytest.raises(FileNotFoundError, match="no checkpoints/step_N"):
        ev.plan(tmp_path / "nothing", protocols_for("sspo"), nemo_rl_dir=tmp_path)
    with pytest.raises(ValueError, match="--suite: unknown 'dapo'"):
        protocols_for("dapo")


def test_dry_run_prints_the_plan(tmp_path, capsys):
    from nemo_granular.cli import main

    run = _fake_run(tmp_path, steps=(30,))
    data = _data_dir(tmp_path)
    assert (
        main(
            [
                "eval-checkpoints",
                str(run),
                "--suite",
                "espo",
                "--nemo-rl",
                str(tmp_path),
                "--data-dir",
                str(data),
                "--dry-run",
            ]
        )
        == 0
    )
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 + 4 and "export" in lines[0] and all("run_eval.py" in x for x in lines[1:])
    assert not (run / "evals.json").exists() and not (run / "evals").exists()


def test_default_launcher_is_the_images_python_in_a_container_job(tmp_path, capsys, monkeypatch):
    """Issue 33.2: in a container job (``NG_CONTAINER``, set in every container step by launch.sh and
    submit_comparison.sh) ``uv run`` fails (it re-syncs NeMo-RL's project and needs a writable cache:
    under pyxis HOME is an empty directory in a read-only root), so ``eval-checkpoints`` starts
    ``run_eval`` with the image's ``python`` by default; ``uv run python`` stays the default
    elsewhere, and an explicit ``--launcher`` wins in both."""
    from nemo_granular.cli import main

    run = _fake_run(tmp_path, steps=(30,))
    argv = [
        "eval-checkpoints",
        str(run),
        "--suite",
        "espo",
        "--nemo-rl",
        str(tmp_path),
        "--data-dir",
        str(_data_dir(tmp_path)),
        "--benchmarks",
        "aime24",
        "--dry-run",
    ]

    def launcher(*extra) -> str:
        assert main([*argv, *extra]) == 0
        line = capsys.readouterr().out.strip().splitlines()[-1]
        return line.split(" && ", 1)[1].split(" --config ", 1)[0]

    monkeypatch.delenv("NG_CONTAINER", raising=False)
    assert launcher() == "uv run python examples/run_eval.py"
    monkeypatch.setenv("NG_CONTAINER", "/lustre/images/nemo-rl.sqsh")
    assert launcher() == "python examples/run_eval.py"
    assert launcher("--launcher", "uv run python examples/run_eval.py") == "uv run python examples/run_eval.py"
    assert ev.default_launcher({"NG_CONTAINER": "img"}) == "python examples/run_eval.py"
    assert ev.default_launcher({}) == ev.DEFAULT_LAUNCHER == "uv run python examples/run_eval.py"


def test_benchmarks_option_plans_only_those_of_the_suite(tmp_path, capsys):
    """``--benchmarks``: only the named benchmarks of the suite are run (the export still once); a
    name outside the suite, or none, is one line, exit 2, nothing planned."""
    from nemo_granular.cli import main

    run = _fake_run(tmp_path, steps=(30,))
    data = _data_dir(tmp_path)
    argv = [
        "eval-checkpoints",
        str(run),
        "--suite",
        "espo",
        "--nemo-rl",
        str(tmp_path),
        "--data-dir",
        str(data),
        "--dry-run",
    ]
    assert main([*argv, "--benchmarks", "math500,aime24"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 + 2 and "export" in lines[0], lines
    assert [re.search(r"evals/(\w+)\.yaml", x).group(1) for x in lines[1:]] == ["aime24", "math500"]  # suite order
    for bad, want in (
        ("aime24,amc23", "'amc23' is not a benchmark of suite espo (aime24, aime25, math500, hmmt25)"),
        (",", "no benchmark given; choose from suite espo"),
    ):
        assert main([*argv, "--benchmarks", bad]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and want in err, err


def test_overrides_anywhere_on_the_command_line_reach_every_run_eval(tmp_path, capsys):
    """KEY=VALUE words go to every run_eval wherever they stand (after the options too: how
    ``submit_comparison.sh --eval-args`` appends them); argparse alone refused them there."""
    from nemo_granular.cli import main

    run = _fake_run(tmp_path, steps=(30,))
    data = _data_dir(tmp_path)
    assert (
        main(
            [
                "eval-checkpoints",
                "env.math.num_workers=1",
                str(run),
                "--suite",
                "espo",
                "--nemo-rl",
                str(tmp_path),
                "--data-dir",
                str(data),
                "--dry-run",
                "eval.seed=7",
            ]
        )
        == 0
    )
    evals = [shlex.split(x) for x in capsys.readouterr().out.strip().splitlines()[1:]]
    assert len(evals) == 4 and all(argv[-2:] == ["env.math.num_workers=1", "eval.seed=7)"] for argv in evals), evals
    assert main(["eval-checkpoints", "a=1", "--suite", "espo", "--dry-run"]) == 2
    assert capsys.readouterr().err.strip() == "nemo-granular eval-checkpoints: error: give at least one RUN_DIR"


def _megatron_run(tmp_path: Path, step: int = 5) -> Path:
    """A run whose checkpoint has NeMo-RL's Megatron layout (what the exporter detects)."""
    run = tmp_path / "espo_megatron"
    weights = run / "checkpoints" / f"step_{step}" / "policy" / "weights"
    (weights / "iter_0000000").mkdir(parents=True)
    (weights / "latest_checkpointed_iteration.txt").write_text("0")
    (weights / "iter_0000000" / "run_config.yaml").write_text("model: {}\n")
    return run


def _make_venv(path: Path, *pth_lines: str) -> Path:
    """A real venv (no pip) whose site-packages holds a ``.pth`` of ``pth_lines``: ``path/bin/python``."""
    import subprocess

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    if pth_lines:
        code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
        site = subprocess.run(
            [str(path / "bin" / "python"), "-c", code], capture_output=True, text=True, check=True
        ).stdout.strip()
        Path(site, "worker_packages.pth").write_text("\n".join(pth_lines) + "\n")
    return path / "bin" / "python"


def _dry_run_export_line(run: Path, nemo_rl: Path, data: Path, **env_extra):
    """``eval-checkpoints --dry-run`` in a world where this interpreter has no Megatron-Bridge
    (the driver venv of a bare ``uv sync``): (exit code, export command or stderr)."""
    import subprocess

    from conftest import env_without_nemo_rl

    env = env_without_nemo_rl(PYTHONPATH=str(ROOT))
    for var in ("NEMO_RL_VENV_DIR", "NG_EXPORT_PYTHON", "NEMO_RL_PY_EXECUTABLES_SYSTEM"):
        env.pop(var, None)
    env.update(env_extra)
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "nemo_granular",
            "eval-checkpoints",
            str(run),
            "--suite",
            "espo",
            "--nemo-rl",
            str(nemo_rl),
            "--data-dir",
            str(data),
            "--dry-run",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if res.returncode:
        return res.returncode, res.stderr.strip()
    return 0, shlex.split(res.stdout.splitlines()[0])


def test_megatron_export_runs_with_an_interpreter_that_has_megatron_bridge(tmp_path):
    """Issue 24.1: the export of a Megatron checkpoint ran with the driver's interpreter (NeMo-RL's
    ``.venv`` of a bare ``uv sync``, no Megatron-Bridge), so every benchmark was skipped. It now
    runs with NeMo-RL's Megatron worker venv, found where NeMo-RL puts it."""
    run = _megatron_run(tmp_path)
    data = _data_dir(tmp_path)
    nemo_rl = tmp_path / "NeMo-RL"
    nemo_rl.mkdir()
    step, hf = run.resolve() / "checkpoints" / "step_5", run.resolve() / "hf" / "step_5"
    boot_tail = ["export", str(step), str(hf), "--no-verify"]

    # nothing with Megatron-Bridge anywhere: refused up front, naming every place looked at (before the
    # fix: planned with this interpreter, whose export then failed with ImportError, benchmarks skipped)
    rc, err = _dry_run_export_line(run, nemo_rl, data)
    assert rc == 2 and err.count("\n") == 0 and "needs Megatron-Bridge" in err
    assert str(nemo_rl / "venvs" / "nemo_rl.models.policy.workers.megatron_policy_worker.MegatronPolicyWorker") in err

    # NeMo-RL's default NEMO_RL_VENV_DIR (<checkout>/venvs): the plugin's worker venv, then the stock one wins
    import sysconfig

    # a worker venv has torch and transformers (here: this venv's packages; no nemo_granular, no Megatron)
    plugin = _make_venv(
        nemo_rl / "venvs" / "nemo_granular.nemo_rl.megatron_worker.GranularMegatronPolicyWorker",
        sysconfig.get_paths()["purelib"],
    )
    rc, argv = _dry_run_export_line(run, nemo_rl, data)
    assert rc == 0 and argv[0] == str(plugin) and argv[1] == "-c" and argv[3:] == boot_tail
    stock = _make_venv(
        nemo_rl / "venvs" / "nemo_rl.models.policy.workers.megatron_policy_worker.MegatronPolicyWorker",
        sysconfig.get_paths()["purelib"],
    )
    rc, argv = _dry_run_export_line(run, nemo_rl, data)
    assert rc == 0 and argv[0] == str(stock)

    # the container: the image's NEMO_RL_VENV_DIR (/opt/ray_venvs there) is where NeMo-RL looks
    image = _make_venv(
        tmp_path / "ray_venvs" / "nemo_rl.models.policy.workers.megatron_policy_worker.MegatronPolicyWorker"
    )
    rc, argv = _dry_run_export_line(run, nemo_rl, data, NEMO_RL_VENV_DIR=str(tmp_path / "ray_venvs"))
    assert rc == 0 and argv[0] == str(image)

    # explicit choices: NG_EXPORT_PYTHON, and NeMo-RL's NEMO_RL_PY_EXECUTABLES_SYSTEM=1 (workers use the driver's)
    rc, argv = _dry_run_export_line(run, nemo_rl, data, NG_EXPORT_PYTHON=f"{plugin} -X utf8")
    assert rc == 0 and argv[:3] == [str(plugin), "-X", "utf8"]
    rc, argv = _dry_run_export_line(run, nemo_rl, data, NEMO_RL_PY_EXECUTABLES_SYSTEM="1")
    assert rc == 0 and argv == [sys.executable, "-m", "nemo_granular", *boot_tail]

    # the printed command really starts the exporter from that interpreter (nemo_granular found by the boot line)
    import subprocess

    from conftest import env_without_nemo_rl

    _, argv = _dry_run_export_line(run, nemo_rl, data)
    res = subprocess.run(
        argv[:3] + ["export", "--help"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env_without_nemo_rl(PYTHONPATH=""),
    )
    assert res.returncode == 0 and "nemo-granular export" in res.stdout, res.stderr[-2000:]


def test_preflight_export_interpreter_must_import_megatron_bridge(tmp_path, capsys):
    """The preflight runs the chosen interpreter: a venv without Megatron-Bridge is one error line
    with that interpreter's own error (eval-checkpoints stops on the same line before running)."""
    from nemo_granular.cli import main
    from nemo_granular.preflight import eval_checks

    bare = _make_venv(tmp_path / "bare")
    found = eval_checks.check_export_interpreter(None, export_python=str(bare))
    assert len(found) == 1 and found[0].level == "error"
    assert f"({bare}; --export-python / NG_EXPORT_PYTHON) cannot import Megatron-Bridge" in found[0].message
    # that interpreter's own error: megatron missing, or (Megatron's sources on PYTHONPATH, as
    # under scripts/nemo_rl_env.sh) the torch they import
    assert re.search(r"ModuleNotFoundError: No module named '(megatron|torch)'$", found[0].message), found[0].message
    run = _megatron_run(tmp_path)
    capsys.readouterr()
    rc = main(
        [
            "eval-checkpoints",
            str(run),
            "--suite",
            "espo",
            "--nemo-rl",
            str(tmp_path),
            "--data-dir",
            str(_data_dir(tmp_path)),
            "--export-python",
            str(bare),
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "cannot import Megatron-Bridge" in err
    assert not (run / "hf").exists() and not (run / "evals").exists()  # nothing ran


def test_dtensor_export_keeps_this_interpreter(tmp_path):
    run = _fake_run(tmp_path, steps=(7,))
    (run / "checkpoints" / "step_7" / "policy" / "weights").mkdir()  # DTensor layout: no Megatron needed
    cmds = ev.plan(run, protocols_for("espo"), nemo_rl_dir=tmp_path, data_dir=_data_dir(tmp_path))
    assert cmds[0].kind == "export" and cmds[0].argv[:3] == [sys.executable, "-m", "nemo_granular"]
    assert cmds[0].exporter is None


def test_select_checkpoint_best_and_last():
    res = {
        "benchmarks": {"a": {}, "b": {}},
        "checkpoints": {
            "10": {"a": 0.5, "b": 0.1},
            "20": {"a": 0.2, "b": 0.2},
            "30": {"a": 0.1, "b": 0.5},
            "40": {"a": 0.9},
        },
    }  # 40: incomplete, never selected
    assert select_checkpoint(res, "best")[0] == 10  # ties 0.3 / 0.3: the earlier
    assert select_checkpoint(res, "last")[0] == 30


# ---------------------------------------------------------------------------- against NeMo-RL
def _keys(d, prefix=""):
    out = set()
    for k, v in d.items():
        out.add(prefix + k)
        if isinstance(v, dict):
            out |= _keys(v, prefix + k + ".")
    return out


@pytest.fixture(scope="module")
def nemo_eval(nemo_rl_src):
    from nemo_rl.utils.config import load_config
    from omegaconf import OmegaConf

    return SimpleNamespace(load=load_config, OmegaConf=OmegaConf, src=nemo_rl_src)


@pytest.mark.nemo_rl
@pytest.mark.parametrize("key", sorted(BENCHMARKS))
def test_configs_have_nemo_rl_eval_schema(nemo_eval, key):
    ours = nemo_eval.OmegaConf.to_container(nemo_eval.load(CONFIGS / f"{key}.yaml"))
    theirs = nemo_eval.OmegaConf.to_container(nemo_eval.load(nemo_eval.src / "examples/configs/evals/eval.yaml"))
    assert _keys(theirs) - _keys(ours) == set()
    b = BENCHMARKS[key]
    if b.builtin:
        assert ours["data"]["dataset_name"] == b.builtin
    else:
        assert ours["data"]["file_format"] == "json" and ours["data"]["problem_key"] == "problem"
    assert (nemo_eval.src / ours["data"]["prompt_file"]).is_file()  # NeMo-RL's prompt, run_eval's cwd


@pytest.mark.nemo_rl
def test_builtin_names_are_nemo_rl_loaders(nemo_eval):
    src = (nemo_eval.src / "examples" / "run_eval.py").read_text()
    for key in ("aime24", "aime25"):
        assert f'"{BENCHMARKS[key].builtin}"' in src  # run_eval routes these through the response registry
    loader = (nemo_eval.src / "nemo_rl/data/datasets/eval_datasets/__init__.py").read_text()
    assert f'dataset_name == "{BENCHMARKS["math500"].builtin}"' in loader


@pytest.mark.nemo_rl
def test_local_benchmark_loads_with_nemo_rl_dataset(nemo_eval, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.chdir(nemo_eval.src)  # run_eval's cwd: the prompt file is NeMo-RL's
    from nemo_rl.data.datasets.eval_datasets import load_eval_dataset

    data = _data_dir(tmp_path, ["hmmt25"], n=4)
    cfg = nemo_eval.load(CONFIGS / "hmmt25.yaml")
    over = [a for a in ev.benchmark_data("hmmt25", data)]
    cfg = nemo_eval.OmegaConf.merge(cfg, nemo_eval.OmegaConf.from_dotlist(over))
    ds = load_eval_dataset(nemo_eval.OmegaConf.to_container(cfg["data"]))
    rows = [json.loads(x) for x in (data / "hmmt25.jsonl").read_text().splitlines()]
    assert len(ds.rekeyed_ds) == len(rows)
    assert [r["problem"] for r in ds.rekeyed_ds] == [r["problem"] for r in rows]
    assert [r["expected_answer"] for r in ds.rekeyed_ds] == [r["answer"] for r in rows]


# run_eval stand-in: NeMo-RL's own config loading (defaults + CLI dotlist, resolved) then a
# deterministic reward per (problem, sample, step); writes what run_eval writes with save_path
SHIM = textwrap.dedent("""
    import json, os, re, sys
    from omegaconf import OmegaConf
    from nemo_rl.utils.config import load_config
    args = sys.argv[1:]
    cfg = load_config(args[args.index("--config") + 1])
    rest = [a for i, a in enumerate(args) if a != "--config" and (i == 0 or args[i - 1] != "--config")]
    cfg = OmegaConf.to_container(OmegaConf.merge(cfg, OmegaConf.from_dotlist(rest)), resolve=True)
    n = cfg["eval"]["num_tests_per_prompt"]
    if n > 1:
        assert cfg["generation"]["temperature"] > 0
    data = cfg["data"]["dataset_name"]
    problems = [json.loads(x) for x in open(data).read().splitlines()]
    step = int(re.search(r"step_(\\d+)", cfg["eval"]["save_path"]).group(1))
    rows = [{"reward": float((i + j + step) % 3 == 0), "prompt": p["problem"], "response": "x",
             "sample_index": i * n + j} for i, p in enumerate(problems) for j in range(n)]
    os.makedirs(cfg["eval"]["save_path"], exist_ok=True)
    json.dump({"num_tests_per_prompt": n, "temperature": cfg["generation"]["temperature"]},
              open(os.path.join(cfg["eval"]["save_path"], "config.json"), "w"))
    json.dump({"evaluation_data": rows}, open(os.path.join(cfg["eval"]["save_path"], "evaluation_data.json"), "w"))
""")


def _expected(problems: int, n: int, step: int) -> float:
    hits = sum(1 for i in range(problems) for j in range(n) if (i + j + step) % 3 == 0)
    return hits / (problems * n)


@pytest.mark.nemo_rl
def test_eval_checkpoints_shimmed_end_to_end(nemo_eval, tmp_path):
    from nemo_granular.cli import main

    sys.path.insert(0, str(Path(__file__).parent))
    from test_report import _write_nemo_rl_run

    run = tmp_path / "sspo_seed0"
    _write_nemo_rl_run(run, "sspo", 0, 20)  # real NeMo-RL Logger output; checkpoints/step_10, step_20
    for s in (10, 20):
        (run / "hf" / f"step_{s}").mkdir(parents=True)
        (run / "hf" / f"step_{s}" / "config.json").write_text("{}")
    data = _data_dir(tmp_path)
    shim = tmp_path / "run_eval_shim.py"
    shim.write_text(SHIM)
    argv = [
        "eval-checkpoints",
        str(run),
        "--suite",
        "sspo",
        "--nemo-rl",
        str(nemo_eval.src),
        "--data-dir",
        str(data),
        "--launcher",
        f"{shlex.quote(sys.executable)} {shim}",
    ]
    assert main(argv) == 0
    res = json.loads((run / "evals.json").read_text())["suites"]["sspo"]
    n_problems = {k: len((data / f"{k}.jsonl").read_text().splitlines()) for k in BENCHMARKS}
    for step in (10, 20):
        for key in PROTOCOLS["sspo"].benchmarks:
            assert res["checkpoints"][str(step)][key] == pytest.approx(_expected(n_problems[key], 1, step))
    assert res["benchmarks"]["amc23"]["problems"] == n_problems["amc23"]
    # a second call finds every result and runs nothing (a failure would have no result file)
    os.remove(data / "amc23.jsonl")
    assert main(argv) == 0
    from nemo_granular.report import report_from_runs

    report = report_from_runs([run], tmp_path / "rep").read_text()
    avgs = {s: statistics.mean(_expected(n_problems[k], 1, s) for k in PROTOCOLS["sspo"].benchmarks) for s in (10, 20)}
    best = max(avgs, key=lambda s: (avgs[s], -s))
    row = next(line for line in report.splitlines() if line.startswith("| sspo | 1 |") and line.count("|") == 10)
    assert row.split("|")[-2].strip() == str(best) and f"| {avgs[best]:.3f} |" in row


# ---------------------------------------------------------------------------- embedded mechanics
def test_synthetic_levels_are_held_out_and_deterministic(tmp_path):
    from nemo_granular.embedded.task import ArithmeticTask

    files = write_synthetic_benchmarks(tmp_path / "a", 4, 9, seed=3)
    again = write_synthetic_benchmarks(tmp_path / "b", 4, 9, seed=3)
    other = write_synthetic_benchmarks(tmp_path / "c", 4, 9, seed=4)
    assert list(files) == ["sum3", "sum4_heldout", "sum5"]
    task = ArithmeticTask(4, 9, 3, 128)
    assert [q for q, _ in read_benchmark(files["sum4_heldout"])] == [p.prompt for p in task.heldout]
    for key, terms in (("sum3", 3), ("sum5", 5)):
        rows = read_benchmark(files[key])
        assert files[key].read_text() == again[key].read_text() != other[key].read_text()
        assert len(rows) == len({q for q, _ in rows}) == 64
        for q, a in rows:
            nums = [int(x) for x in re.fullmatch(r"Q:([\d+]+)\n", q).group(1).split("+")]
            assert len(nums) == terms and all(1 <= x <= 9 for x in nums) and str(sum(nums)) == a
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "x", "answer": "1"}\n{"question": "y"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: expected a JSON object with 'problem'"):
        read_benchmark(bad)


class _Oracle(torch.nn.Module):
    """Stands in for a policy: answers correctly when the first term is odd, else a wrong answer;
    under sampling, additionally wrong on every other call (so avg@k differs from greedy)."""

    def __init__(self, tok):
        super().__init__()
        self.tok, self.calls = tok, 0

    def generate(self, input_ids, attention_mask, do_sample=False, **kw):
        self.calls += 1
        texts = self.tok.batch_decode(input_ids, skip_special_tokens=True)
        outs = []
        for row, t in enumerate(texts):
            terms = [int(x) for x in t.strip()[2:].split("+")]
            good = terms[0] % 2 == 1 and not (do_sample and row % 2 == 1)
            outs.append(f"{terms[0]}+{terms[1]}=0\n\nA:{sum(terms) if good else -1}")
        ids = [self.tok(o, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id] for o in outs]
        L = max(map(len, ids))
        resp = torch.tensor([x + [self.tok.pad_token_id] * (L - len(x)) for x in ids])
        seq = torch.cat([input_ids, resp], 1)
        logits = tuple(torch.zeros(len(texts), 64) for _ in range(L))
        return SimpleNamespace(sequences=seq, logits=logits)


def test_score_is_avg_at_k(tmp_path):
    from nemo_granular.embedded.models import build_tokenizer

    tok = build_tokenizer()
    problems = read_benchmark(write_synthetic_benchmarks(tmp_path, 4, 9, seed=0)["sum3"])
    oracle = _Oracle(tok)
    odd = [int(q[2:].split("+")[0]) % 2 == 1 for q, _ in problems]
    assert score(oracle, tok, problems, Setting(1, 0.0), 40, seed=0) == pytest.approx(sum(odd) / len(odd))
    # 4 samples per problem, rows interleaved problem-major: row r = 4·i + j, wrong on odd rows
    k = 4
    hits = sum(1 for i, o in enumerate(odd) for j in range(k) if o and (k * i + j) % 2 == 0)
    assert score(oracle, tok, problems, Setting(k, 0.6), 40, seed=0, batch_size=1000) == pytest.approx(
        hits / (k * len(problems))
    )


def test_embedded_evaluate_run_writes_evals_json(tmp_path):
    from nemo_granular.embedded.models import build_policy, build_tokenizer
    from nemo_granular.evals.embedded import evaluate_run

    tok = build_tokenizer()
    mcfg = SimpleNamespace(
        path=None,
        hidden_size=16,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=32,
        max_positions=128,
        moe=False,
    )
    policy = build_policy(mcfg, tok)
    run = tmp_path / "grpo_seed0"
    for step in (0, 10, 20):
        d = run / "checkpoints" / f"step_{step:06d}"
        policy.save_pretrained(str(d / "policy"))
        tok.save_pretrained(str(d / "tokenizer"))
    (run / "config.yaml").write_text(
        yaml.safe_dump(
            {
                "seed": 0,
                "task": {"kind": "arithmetic", "num_terms": 3, "max_term": 5, "heldout_size": 8},
                "rl": {"max_new_tokens": 8},
                "model": {},
            }
        )
    )
    tiny = tmp_path / "tiny.jsonl"
    tiny.write_text("".join(json.dumps({"prompt": f"Q:{i}+1\n", "answer": str(i + 1)}) + "\n" for i in range(4)))
    data = evaluate_run(
        run, protocols_for("sspo") + protocols_for("sppo"), {"tiny": tiny}, max_samples=2, log=lambda m: None
    )
    assert sorted(map(int, data["suites"]["sspo"]["checkpoints"])) == [0, 10, 20]
    assert sorted(map(int, data["suites"]["sppo"]["checkpoints"])) == [0, 20]  # base and last
    assert data["suites"]["sppo"]["benchmarks"]["tiny"]["samples_per_problem"] == 2
    assert data["suites"]["sppo"]["benchmarks"]["tiny"]["metric"] == "avg@2"
    assert json.loads((run / "evals.json").read_text()) == data


def _tiny_embedded_run(tmp_path: Path, steps=(0, 10, 20), rl_steps=20) -> tuple[Path, Path]:
    from nemo_granular.embedded.models import build_policy, build_tokenizer

    tok = build_tokenizer()
    mcfg = SimpleNamespace(
        path=None,
        hidden_size=16,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=32,
        max_positions=128,
        moe=False,
    )
    policy = build_policy(mcfg, tok)
    run = tmp_path / "grpo_seed0"
    for step in steps:
        d = run / "checkpoints" / f"step_{step:06d}"
        policy.save_pretrained(str(d / "policy"))
        tok.save_pretrained(str(d / "tokenizer"))
    (run / "config.yaml").write_text(
        yaml.safe_dump(
            {
                "seed": 0,
                "task": {"kind": "arithmetic", "num_terms": 3, "max_term": 5, "heldout_size": 8},
                "rl": {"max_new_tokens": 8, "steps": rl_steps},
                "model": {},
            }
        )
    )
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    tiny = tmp_path / "tiny.jsonl"
    tiny.write_text("".join(json.dumps({"prompt": f"Q:{i}+1\n", "answer": str(i + 1)}) + "\n" for i in range(2)))
    return run, tiny


def test_embedded_steps_are_honoured_or_refused_naming_the_steps_that_exist(tmp_path, capsys):
    """`--steps 55` on an embedded run was ignored (steps 90 and 100 evaluated, exit 0)."""
    from nemo_granular.cli import main

    run, tiny = _tiny_embedded_run(tmp_path)
    argv = ["eval-checkpoints", str(run), "--suite", "sspo", "--benchmark", f"tiny={tiny}", "--max-samples", "1"]
    capsys.readouterr()
    assert main([*argv, "--steps", "55"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--steps: {run} has no checkpoint of step 55 (its checkpoints: 0, 10, 20)" in err
    assert not (run / "evals.json").exists() and not (run / "benchmarks").exists()
    assert main([*argv, "--steps", "10"]) == 0
    data = json.loads((run / "evals.json").read_text())
    assert list(data["suites"]["sspo"]["checkpoints"]) == ["10"]  # that step, and only that one


def test_embedded_missing_final_checkpoint_is_named(tmp_path, capsys):
    """A run whose final checkpoint is missing had its newest one evaluated as "the last" without a word."""
    from nemo_granular.cli import main

    run, tiny = _tiny_embedded_run(tmp_path, rl_steps=30)
    capsys.readouterr()
    assert (
        main(["eval-checkpoints", str(run), "--suite", "sppo", "--benchmark", f"tiny={tiny}", "--max-samples", "1"])
        == 0
    )
    err = capsys.readouterr().err
    note = "the run's final checkpoint (step 30, rl.steps) is missing: step 20 is evaluated as the last"
    assert [line for line in err.splitlines() if "final checkpoint" in line] == [f"[evals grpo_seed0] note: {note}"]
    proto = json.loads((run / "evals.json").read_text())["suites"]["sppo"]["protocol"]
    assert proto["select_note"].endswith(note)
    # a complete run says nothing of the kind
    done, tiny = _tiny_embedded_run(tmp_path / "done", rl_steps=20)
    assert (
        main(["eval-checkpoints", str(done), "--suite", "sppo", "--benchmark", f"tiny={tiny}", "--max-samples", "1"])
        == 0
    )
    assert "final checkpoint" not in capsys.readouterr().err


def test_plan_refuses_steps_without_a_checkpoint(tmp_path):
    run = _fake_run(tmp_path)
    message = r"--steps: .* has no checkpoint of step 15, 55 \(its checkpoints: 10, 20, 25\)"
    with pytest.raises(ValueError, match=message):
        ev.plan(run, protocols_for("sppo"), nemo_rl_dir=tmp_path, data_dir=_data_dir(tmp_path), steps=[10, 15, 55])
    cmds = ev.plan(run, protocols_for("sppo"), nemo_rl_dir=tmp_path, data_dir=_data_dir(tmp_path), steps=[20])
    assert {c.step for c in cmds} == {20}
