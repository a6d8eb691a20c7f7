"""The source cache (scripts/sources.sh) and the worlds scripts/test.sh builds from it.

Real git: two repositories made here, one pinning the other as a submodule (a gitlink, as NeMo-RL pins
Automodel), filled with ``--from`` their folder; the pins file is the test's own (``--pins``), the same
format as scripts/sources.pins.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import env_without_nemo_rl

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ROOT / "scripts" / "sources.py"
GIT_ENV = {
    "GIT_AUTHOR_NAME": "t",
    "GIT_AUTHOR_EMAIL": "t@t",
    "GIT_COMMITTER_NAME": "t",
    "GIT_COMMITTER_EMAIL": "t@t",
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_CONFIG_NOSYSTEM": "1",
}


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=cwd, check=True, capture_output=True, text=True, env={**os.environ, **GIT_ENV}
    ).stdout.strip()


def _repo(path: Path, files: dict[str, str], gitlinks: dict[str, str] | None = None) -> str:
    path.mkdir(parents=True)
    _git(path, "init", "-q")
    for name, text in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text)
    _git(path, "add", ".")
    for where, commit in (gitlinks or {}).items():
        _git(path, "update-index", "--add", "--cacheinfo", f"160000,{commit},{where}")
    _git(path, "commit", "-q", "-m", "pin")
    return _git(path, "rev-parse", "HEAD")


@pytest.fixture
def mirrors(tmp_path):
    """``mirrors/`` holding two repositories (bare clones, as the offline mirrors are) and a pins file."""
    work = tmp_path / "work"
    model = _repo(
        work / "Automodel",
        {"nemo_automodel/__init__.py": "", "pyproject.toml": "[project]\n", "docs/big.md": "not checked out"},
    )
    rl = _repo(
        work / "RL",
        {"nemo_rl/__init__.py": "VERSION = 1\n", "pyproject.toml": "[project]\n", "uv.lock": "not checked out"},
        gitlinks={"3rdparty/Automodel-workspace/Automodel": model},
    )
    mirrors = tmp_path / "mirrors"
    for name in ("RL", "Automodel"):
        subprocess.run(
            ["git", "clone", "-q", "--bare", str(work / name), str(mirrors / f"o+{name}" / "repo")],
            check=True,
            env={**os.environ, **GIT_ENV},
        )
    pins = tmp_path / "sources.pins"
    pins.write_text(
        f"nemo-rl  o/RL  {rl}  nemo_rl pyproject.toml\n"
        "automodel  o/Automodel  gitlink:nemo-rl:3rdparty/Automodel-workspace/Automodel  nemo_automodel\n"
        "nemo-rl-old  o/RL  " + "0" * 40 + "  nemo_rl\n"
        "world main  nemo-rl  nemo-rl  nemo-rl  automodel\n"
        "world old   nemo-rl-old  nemo-rl  nemo-rl  automodel\n"
    )
    return {"dir": mirrors, "pins": pins, "rl": rl, "model": model, "cache": tmp_path / "cache"}


def _sources(m, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SOURCES), *args, "--pins", str(m["pins"]), "--cache", str(m["cache"])],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **GIT_ENV},
    )


def test_fill_from_local_mirrors_checks_out_each_pin_and_its_gitlink(mirrors):
    m = mirrors
    done = _sources(m, "--from", str(m["dir"]))
    assert done.returncode == 0, done.stderr
    rl, model = m["cache"] / f"nemo-rl-{m['rl'][:12]}", m["cache"] / f"automodel-{m['model'][:12]}"
    # the pinned paths only, at the pinned commits (the gitlink read from the NeMo-RL tree's own commit)
    assert sorted(p.name for p in rl.iterdir()) == [".nemo-granular-source.json", "nemo_rl", "pyproject.toml"]
    assert (rl / "nemo_rl" / "__init__.py").read_text() == "VERSION = 1\n"
    assert sorted(p.name for p in model.iterdir()) == [".nemo-granular-source.json", "nemo_automodel"]
    record = json.loads((rl / ".nemo-granular-source.json").read_text())
    assert record["commit"] == m["rl"]
    assert record["gitlinks"] == {"3rdparty/Automodel-workspace/Automodel": m["model"]}
    # a pin that no git directory holds is named, and its world is incomplete
    assert f"nemo-rl-old: commit {'0' * 40}" in done.stdout and "world old: incomplete" in done.stdout
    assert "world main: complete" in done.stdout
    # nothing half-written left in the cache
    assert not [p for p in m["cache"].iterdir() if ".partial" in p.name]


def test_rerun_is_a_no_op_and_a_tree_at_another_commit_is_refused(mirrors):
    m = mirrors
    assert _sources(m, "--from", str(m["dir"])).returncode == 0
    tree = m["cache"] / f"nemo-rl-{m['rl'][:12]}"
    stamp = (tree / "nemo_rl" / "__init__.py").stat().st_mtime_ns
    again = _sources(m, "--from", str(m["dir"]))
    assert again.returncode == 0 and f"nemo-rl {m['rl'][:12]}: present at {tree}" in again.stdout, again.stdout
    assert (tree / "nemo_rl" / "__init__.py").stat().st_mtime_ns == stamp
    record = tree / ".nemo-granular-source.json"
    record.write_text(json.dumps({**json.loads(record.read_text()), "commit": "1" * 40}))
    refused = _sources(m, "--from", str(m["dir"]))
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert f"holds {'1' * 40}, but nemo-rl is pinned at {m['rl']}" in refused.stderr
    assert _sources(m, "env", "main").returncode == 2  # the env of a world never uses such a tree


def test_env_exports_a_complete_world_and_names_what_is_missing(mirrors):
    m = mirrors
    missing = _sources(m, "env", "main")
    assert missing.returncode == 3 and missing.stdout == "" and "not in the source cache" in missing.stderr
    assert _sources(m, "--from", str(m["dir"])).returncode == 0
    env = _sources(m, "env", "main")
    rl, model = m["cache"] / f"nemo-rl-{m['rl'][:12]}", m["cache"] / f"automodel-{m['model'][:12]}"
    assert env.returncode == 0 and env.stdout.splitlines() == [
        f"export NEMO_RL_SRC={rl}",
        f"export MEGATRON_BRIDGE_SRC={rl}/src",
        f"export MEGATRON_LM_SRC={rl}",
        f"export AUTOMODEL_SRC={model}",
    ], env.stdout
    old = _sources(m, "env", "old")
    assert old.returncode == 3 and f"nemo-rl-old {'0' * 12}" in old.stderr
    assert _sources(m, "env", "nope").returncode == 2


def test_bad_from_folder_is_one_line(mirrors, tmp_path):
    bad = _sources(mirrors, "--from", str(tmp_path / "absent"))
    assert bad.returncode == 2 and bad.stderr == f"sources: --from {tmp_path / 'absent'}: not a folder\n"


def test_the_worlds_without_a_cache_say_they_did_not_run(tmp_path):
    """scripts/test.sh on a machine with an empty source cache: the standalone and Slurm worlds run (here
    filtered to one test by -k), the NeMo-RL worlds say first and last that they did not run, and why."""
    # one pytest process per world (no xdist workers, each of which would collect the whole suite again)
    env = env_without_nemo_rl(XDG_CACHE_HOME=str(tmp_path / "cache"), CI="true", NEMO_GRANULAR_TEST_WORKERS="0")
    for var in ("NEMO_GRANULAR_SOURCES", "NEMO_RL_V070_SRC", "NEMO_RL_WORLD", "PYTEST_XDIST_WORKER"):
        env.pop(var, None)
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "test.sh"), "-k", "test_vendored_code_check_finds_each_kind"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    first = [line for line in lines if line.startswith("world ")][:4]
    last = lines[lines.index("=== the worlds") + 1 :]
    assert first[0] == "world standalone: will run" and first[3] == "world slurm: will run", first
    assert first[1].startswith("world main: will NOT run: NeMo-RL world main: not in the source cache"), first
    assert first[2].startswith("world v0.7.0: will NOT run:"), first
    assert last[0].startswith("world standalone: ran, passed (1 passed, 0 failed"), last
    assert last[1].startswith("world main: did NOT run: NeMo-RL world main: not in the source cache"), last
    assert last[2].startswith("world slurm: ran, no test selected"), last
    assert last[3].startswith("world v0.7.0: did NOT run:"), last
