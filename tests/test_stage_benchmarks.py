"""``nemo-granular stage-benchmarks``: every benchmark of the three paper suites staged for offline
eval jobs, under the names ``eval-checkpoints --data-dir`` reads.

No network: the sources are local copies of each dataset repository (``--mirror``) in the layouts
the Hub repositories use (split-named JSON Lines, a README ``configs:`` block for AIME 2025's two
configs, a parquet shard for HMMT), read by the real ``datasets`` library. The eval side is then
checked with NeMo-RL's own loaders under ``HF_HUB_OFFLINE=1`` with an empty ``HF_HOME``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_granular.cli import main as top_main
from nemo_granular.evals import nemo_rl as ev
from nemo_granular.evals.staging import MANIFEST, SOURCES, staging_problems, suite_benchmarks
from nemo_granular.evals.suite import BENCHMARKS, PROTOCOLS

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "nemo_granular" / "configs" / "evals"


def _source_rows(key: str, config, ci: int, n: int) -> tuple[list[dict], list[dict]]:
    """(rows in the source's own columns, the {problem, answer} rows staging must write)."""
    src = SOURCES[key]
    rows, want = [], []
    for i in range(n + ci):
        q = f"{key} {config or ''} #{i}: compute {i} + {ci}."
        if key.startswith("aime"):
            a, text = 100 * ci + i, str(100 * ci + i)  # AIME answers are integers
        elif key == "olympiadbench":
            a, text = [f"$\\frac{{{i}}}{{2}}$"], f"\\frac{{{i}}}{{2}}"  # a one-element list in $...$
        else:
            a, text = f" \\sqrt{{{i}}} ", f"\\sqrt{{{i}}}"
        rows.append({src.problem: q, src.answer: a, "id": i})
        want.append({"problem": q, "answer": text})
    return rows, want


def write_mirror(root: Path, n: int = 3) -> dict[str, list[dict]]:
    """A local copy of every source repository; returns {key: the rows staging must write}."""
    from datasets import Dataset

    expected = {}
    for key, src in SOURCES.items():
        repo = root / src.repo
        repo.mkdir(parents=True)
        want_all = []
        readme = ["---", "configs:"]
        for ci, config in enumerate(src.configs):
            rows, want = _source_rows(key, config, ci, n)
            want_all += want
            if config is not None:  # named configs: the README's configs block
                name = f"{config}.jsonl"
                readme += [f"- config_name: {config}", "  data_files:", f"  - split: {src.split}", f"    path: {name}"]
            elif key == "hmmt25":  # a parquet shard named by split (data/train-00000-of-00001.parquet)
                (repo / "data").mkdir()
                Dataset.from_list(rows).to_parquet(str(repo / "data" / f"{src.split}-00000-of-00001.parquet"))
                continue
            else:
                name = f"{src.split}.jsonl"  # split inferred from the file name
            (repo / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        if len(readme) > 2:
            (repo / "README.md").write_text("\n".join(readme + ["---", ""]))
        expected[key] = want_all
    # a decoy split that must not be read
    (root / SOURCES["math500"].repo / "train.jsonl").write_text(
        json.dumps({"problem": "decoy", "answer": "0", "id": 0}) + "\n"
    )
    return expected


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def stage_cli(*argv, capsys):
    capsys.readouterr()
    rc = top_main(["stage-benchmarks", *map(str, argv)])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


@pytest.fixture(scope="module")
def mirror(tmp_path_factory):
    pytest.importorskip("datasets")  # the tests that stage read the mirror with the real library
    root = tmp_path_factory.mktemp("mirror")
    return root, write_mirror(root)


def test_suites_cover_every_benchmark_once():
    assert suite_benchmarks("espo") == ["aime24", "aime25", "math500", "hmmt25"]
    assert set(suite_benchmarks("all")) == set(BENCHMARKS) == set(SOURCES)
    for name, proto in PROTOCOLS.items():
        assert suite_benchmarks(name) == list(proto.benchmarks)


def test_stage_all_suites_then_resume_and_never_overwrite(mirror, tmp_path, capsys):
    root, expected = mirror
    data = tmp_path / "benchmarks"
    rc, out, err = stage_cli("--suite", "all", "--data-dir", data, "--mirror", root, capsys=capsys)
    assert rc == 0, err
    for key in BENCHMARKS:
        path = data / f"{key}.jsonl"
        assert read_jsonl(path) == expected[key], key  # the exact rows, in source order, configs concatenated
        # the file eval-checkpoints reads for this benchmark
        assert ev.benchmark_data(key, data)[0] == f"data.dataset_name={path.resolve()}"
    assert len(read_jsonl(data / "aime25.jsonl")) == 3 + 4  # AIME2025-I then AIME2025-II
    manifest = json.loads((data / MANIFEST).read_text())
    assert manifest["aime25"]["configs"] == ["AIME2025-I", "AIME2025-II"] and manifest["hmmt25"]["problems"] == 3
    assert not [p for p in data.iterdir() if p.name.startswith(".")]  # no temporary file left
    assert staging_problems("all", data, env={"HF_HUB_OFFLINE": "1"}) == []
    rc, out, err = stage_cli("--suite", "all", "--data-dir", data, "--check", capsys=capsys)
    assert rc == 0 and "every benchmark staged" in out

    # rerun: everything kept, nothing rewritten (same inode, same bytes)
    before = {p.name: (p.stat().st_ino, p.read_bytes()) for p in data.glob("*.jsonl")}
    rc, out, err = stage_cli("--suite", "all", "--data-dir", data, "--mirror", root, capsys=capsys)
    assert rc == 0 and out.count("already staged, kept") == len(BENCHMARKS)
    assert {p.name: (p.stat().st_ino, p.read_bytes()) for p in data.glob("*.jsonl")} == before

    # an interrupted staging resumes: only the missing file is written
    os.remove(data / "hmmt25.jsonl")
    rc, out, err = stage_cli("--suite", "espo", "--data-dir", data, "--mirror", root, capsys=capsys)
    assert rc == 0 and out.count("kept") == 3 and read_jsonl(data / "hmmt25.jsonl") == expected["hmmt25"]

    # a file that is not a staged benchmark is refused in one line, and left as it was
    (data / "amc23.jsonl").write_text("not json\n")
    rc, out, err = stage_cli("--suite", "sspo", "--data-dir", data, "--mirror", root, capsys=capsys)
    assert rc == 2 and err.count("\n") == 1 and "amc23.jsonl:1: not a staged benchmark line" in err
    assert (data / "amc23.jsonl").read_text() == "not json\n"


def test_stage_errors_are_one_line_and_write_nothing(mirror, tmp_path, capsys):
    root, _ = mirror
    data = tmp_path / "d"
    rc, _, err = stage_cli("--suite", "espo", "--data-dir", data, "--mirror", tmp_path / "nowhere", capsys=capsys)
    assert rc == 2 and err.count("\n") == 1 and "--mirror: no" in err and "HuggingFaceH4/aime_2024" in err
    assert not list(data.glob("*.jsonl"))
    with pytest.raises(SystemExit) as exc:
        stage_cli("--suite", "nope", "--data-dir", data, capsys=capsys)
    assert exc.value.code == 2 and "--suite" in capsys.readouterr().err


def test_preflight_names_what_an_offline_eval_job_cannot_load(mirror, tmp_path, capsys):
    """Before staging, with HF_HUB_OFFLINE=1: every ESPO benchmark is a problem (NeMo-RL's AIME and
    MATH500 loaders download; HMMT25 has none); after staging, none."""
    from nemo_granular.preflight import eval_checks

    root, _ = mirror
    data = tmp_path / "espo"
    lines = staging_problems("espo", data, env={"HF_HUB_OFFLINE": "1"})
    assert [x.split(":")[0] for x in lines] == ["aime24", "aime25", "math500", "hmmt25"]
    assert "NeMo-RL's math500 loader downloads" in lines[2] and "stage-benchmarks --suite espo" in lines[2]
    online = staging_problems("espo", data, env={})
    assert [x.split(":")[0] for x in online] == ["hmmt25"]  # online, NeMo-RL loads the other three itself
    capsys.readouterr()
    assert eval_checks.main(["--eval-suite", "espo", "--data-dir", str(data)]) in (0, 1)
    assert stage_cli("--suite", "espo", "--data-dir", data, "--mirror", root, capsys=capsys)[0] == 0
    assert eval_checks.main(["--eval-suite", "espo", "--data-dir", str(data)]) == 0
    assert eval_checks.check_staged_benchmarks("espo", data, env={"HF_HUB_OFFLINE": "1"}) == []
    bad = eval_checks.check_staged_benchmarks("sspo", data, env={"HF_HUB_OFFLINE": "1"})
    assert sorted(f.message.split(":")[0] for f in bad) == ["amc23", "minerva_math", "olympiadbench"]


# without the datasets library (the quick-start venv has none): a blocker on the import path
NO_DATASETS = r"""
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "datasets" or name.startswith("datasets."):
            raise ModuleNotFoundError(f"No module named {name!r}")
sys.meta_path.insert(0, Block())
from nemo_granular.cli import main
sys.exit(main(["stage-benchmarks", *sys.argv[1:]]))
"""


def test_missing_datasets_is_one_line_with_the_install_command_and_creates_nothing(tmp_path):
    """It was `No module named 'datasets'`, no hint, and an empty --data-dir left behind."""
    data = tmp_path / "new" / "benchmarks"
    res = subprocess.run(
        [sys.executable, "-c", NO_DATASETS, "--suite", "espo", "--data-dir", str(data)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
    assert "needs the Python package 'datasets'" in res.stderr
    assert f"{sys.executable} -m pip install 'datasets>=4.0.0'" in res.stderr
    assert not (tmp_path / "new").exists()
    # what is already staged needs no datasets: kept, and the command succeeds
    data.mkdir(parents=True)
    for key in suite_benchmarks("espo"):
        (data / f"{key}.jsonl").write_text(json.dumps({"problem": "1+1?", "answer": "2"}) + "\n")
    res = subprocess.run(
        [sys.executable, "-c", NO_DATASETS, "--suite", "espo", "--data-dir", str(data)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert res.returncode == 0 and res.stdout.count("already staged, kept") == 4, res.stderr


def test_check_says_what_is_true_of_the_environment(tmp_path, capsys, monkeypatch):
    """--check judges as for an offline node; it used to say `HF_HUB_OFFLINE ... is set` when it was not."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    rc, out, err = stage_cli("--suite", "espo", "--data-dir", tmp_path / "none", "--check", capsys=capsys)
    assert rc == 1 and "is set" not in err and "OFFLINE" not in err
    assert "math500: no " in err and "an eval node without internet (as --check assumes)" in err
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    rc, out, err = stage_cli("--suite", "espo", "--data-dir", tmp_path / "none", "--check", capsys=capsys)
    assert rc == 1 and "HF_DATASETS_OFFLINE is set" in err and "HF_HUB_OFFLINE" not in err
    assert not (tmp_path / "none").exists()


@pytest.mark.parametrize("check", [False, True])
def test_data_dir_that_is_a_file_is_refused_in_one_line(tmp_path, capsys, check):
    """It was a raw `File exists` (and --check listed `no FILE/aime24.jsonl`)."""
    f = tmp_path / "benchmarks"
    f.write_text("mine\n")
    rc, out, err = stage_cli("--suite", "espo", "--data-dir", f, *(["--check"] if check else []), capsys=capsys)
    assert rc == 2 and err.count("\n") == 1, err
    assert f"--data-dir {f}: is a file, not a directory" in err
    assert f.read_text() == "mine\n" and sorted(tmp_path.iterdir()) == [f]


def test_prepare_math_writes_the_math500_file_eval_checkpoints_reads(tmp_path):
    """``slurm/prepare_math_level3to5.py`` wrote MATH-500 only as ``math500_test.jsonl`` (the
    training configs' validation file), while ``eval-checkpoints --data-dir`` reads ``math500.jsonl``."""
    pytest.importorskip("datasets")  # the script needs it

    root = tmp_path / "mirror"
    expected = write_mirror(root)
    subsets = [
        "algebra",
        "counting_and_probability",
        "geometry",
        "intermediate_algebra",
        "number_theory",
        "prealgebra",
        "precalculus",
    ]
    math = root / "EleutherAI" / "hendrycks_math"
    math.mkdir(parents=True)
    readme = ["---", "configs:"]
    for s in subsets:
        rows = [
            {"problem": f"{s} {lvl}", "solution": f"so \\boxed{{{lvl}}}", "level": f"Level {lvl}", "type": s}
            for lvl in (1, 3, 5)
        ]
        (math / f"{s}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        readme += [f"- config_name: {s}", "  data_files:", "  - split: train", f"    path: {s}.jsonl"]
    (math / "README.md").write_text("\n".join(readme + ["---", ""]))
    out = tmp_path / "data"
    cmd = [sys.executable, str(ROOT / "slurm" / "prepare_math_level3to5.py"), "--out", str(out), "--mirror", str(root)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert read_jsonl(out / "math500.jsonl") == expected["math500"]
    assert ev.benchmark_data("math500", out)[0] == f"data.dataset_name={(out / 'math500.jsonl').resolve()}"
    assert (out / "math500_test.jsonl").read_bytes() == (out / "math500.jsonl").read_bytes()
    train = read_jsonl(out / "math_level3to5_train.jsonl")
    assert sorted((r["type"], r["answer"]) for r in train) == sorted((s, str(lvl)) for s in subsets for lvl in (3, 5))
    # rerun: kept, not rewritten
    stamp = {p.name: p.stat().st_ino for p in out.glob("*.jsonl")}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0 and {p.name: p.stat().st_ino for p in out.glob("*.jsonl")} == stamp


# the eval side of an offline node: the data section eval-checkpoints gives run_eval (our config +
# benchmark_data's overrides), loaded the way NeMo-RL's examples/run_eval.py:setup_data loads it
OFFLINE_LOADER = r"""
import json, sys
from pathlib import Path
from omegaconf import OmegaConf
from nemo_rl.utils.config import load_config
from nemo_rl.data.datasets import load_eval_dataset, load_response_dataset
from nemo_granular.evals import nemo_rl as ev
configs, data = Path(sys.argv[1]), (Path(sys.argv[2]) if sys.argv[2] != "-" else None)
out = {}
for key in sys.argv[3:]:
    cfg = OmegaConf.merge(load_config(str(configs / f"{key}.yaml")),
                          OmegaConf.from_dotlist(ev.benchmark_data(key, data) if data else []))
    dc = OmegaConf.to_container(cfg["data"], resolve=True)
    try:
        if dc["dataset_name"] in {"AIME2024", "AIME2025", "AIME2026"}:   # run_eval's branch
            rows = [[m["messages"][0]["content"], m["messages"][1]["content"]] for m in load_response_dataset(dc).dataset]
        else:
            rows = [[r["problem"], r["expected_answer"]] for r in load_eval_dataset(dc).rekeyed_ds]
        out[key] = {"rows": rows}
    except Exception as err:
        out[key] = {"error": type(err).__name__ + ": " + str(err).splitlines()[0][:200]}
print("RESULT " + json.dumps(out))
"""


def _load_offline(nemo_rl_src: Path, tmp_path: Path, data: Path | None, keys: list[str]) -> dict:
    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        HF_HOME=str(tmp_path / "empty_hf_home"),
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )
    res = subprocess.run(
        [sys.executable, "-c", OFFLINE_LOADER, str(CONFIGS), str(data or "-"), *keys],
        cwd=nemo_rl_src,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    line = next((x for x in res.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line, res.stderr[-3000:]
    return json.loads(line[len("RESULT ") :])


@pytest.mark.nemo_rl
def test_offline_eval_loads_every_staged_benchmark_with_nemo_rl(nemo_rl_src, mirror, tmp_path, capsys):
    root, expected = mirror
    # before: NeMo-RL's own loaders on an offline node with an empty cache
    before = _load_offline(nemo_rl_src, tmp_path, None, ["aime24", "aime25", "math500"])
    assert all("error" in before[k] for k in before), before
    data = tmp_path / "benchmarks"
    assert stage_cli("--suite", "all", "--data-dir", data, "--mirror", root, capsys=capsys)[0] == 0
    after = _load_offline(nemo_rl_src, tmp_path, data, sorted(BENCHMARKS))
    for key in BENCHMARKS:
        assert "rows" in after[key], (key, after[key])
        assert after[key]["rows"] == [[r["problem"], r["answer"]] for r in expected[key]], key
