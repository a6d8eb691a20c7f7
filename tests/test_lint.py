"""The linter and the formatter: ``ruff check`` and ``ruff format --check`` (configured in pyproject.toml's
``[tool.ruff]``) pass on the package, the tests, the benchmarks and scripts/*.py. ruff comes with the
``test`` extra; without it the tests skip, which fails the run under CI (tests/conftest.py)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINTED = ("nemo_granular", "tests", "benchmarks", "scripts")


def test_ruff_check_passes():
    if importlib.util.find_spec("ruff") is None:
        pytest.skip("ruff is not installed (pip install -e '.[test]' installs it)")
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", *LINTED],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"ruff check {' '.join(LINTED)} failed:\n{proc.stdout}{proc.stderr}"


def test_ruff_format_leaves_every_file_as_it_is():
    """House style (issue #35): the code is as ``ruff format`` writes it; to format:
    ``.venv/bin/python -m ruff format nemo_granular tests benchmarks scripts``."""
    if importlib.util.find_spec("ruff") is None:
        pytest.skip("ruff is not installed (pip install -e '.[test]' installs it)")
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "--no-cache", *LINTED],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"ruff format --check {' '.join(LINTED)} failed:\n{proc.stdout}{proc.stderr}"


def test_no_chained_conditional_expressions_in_the_package():
    """House style (issue #35): a conditional expression never holds another (``a if x else b if y else c``);
    such a choice is written as statements."""
    import ast

    chained = [
        f"{p.relative_to(ROOT)}:{node.lineno}"
        for p in sorted((ROOT / "nemo_granular").rglob("*.py"))
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.IfExp) and (isinstance(node.body, ast.IfExp) or isinstance(node.orelse, ast.IfExp))
    ]
    assert not chained, chained


SOURCED = {"scripts/nemo_rl_env.sh"}  # meant for `source`, not to be run


def test_scripts_with_a_shebang_are_executable_in_git():
    """The docs run the launchers by path (``/lustre/nemo-granular/slurm/submit_comparison.sh ...``):
    a script git holds without its executable bit fails there with "Permission denied" (found when
    the Slurm tests started running docs/slurm.md's stories word for word). Every tracked file of
    slurm/, scripts/ and tests/harness/ that starts with ``#!`` has mode 100755, but sourced ones."""
    listed = subprocess.run(
        ["git", "ls-files", "-s", "slurm", "scripts", "tests/harness"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    if not listed:
        pytest.skip("not a git checkout")
    modes = {line.split("\t")[1]: line.split()[0] for line in listed}
    shebang = [p for p in modes if p not in SOURCED and (ROOT / p).read_bytes()[:2] == b"#!"]
    assert shebang and not [p for p in shebang if modes[p] != "100755"], {p: modes[p] for p in shebang}
