"""What a new user reads before anything runs: the shell scripts they run pass shellcheck, both
NeMo-RL launchers explain their overrides the same way, the install story is one story (the
README, docs/nemo-rl.md §1–§2 and the launchers' missing-NeMo-RL messages), and the README says
how long the full demo takes."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import env_without_nemo_rl

ROOT = Path(__file__).resolve().parents[1]
INSTALL = "uv pip install --no-deps -e"
OVERRIDES = "Unknown arguments are Hydra overrides (a.b=v, +a.b=v, ++a.b=v, ~a.b)"


def _shellcheck() -> str | None:
    """shellcheck's path; installed with apt-get when missing and root (as tests/test_slurm.py does)."""
    if shutil.which("shellcheck") is None and os.geteuid() == 0 and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True)
        subprocess.run(
            ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "shellcheck"], env=env, capture_output=True
        )
    return shutil.which("shellcheck")


def test_scripts_pass_shellcheck():
    exe = _shellcheck()
    if exe is None:
        pytest.skip("shellcheck missing (not root, or apt-get cannot install it)")
    scripts = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "scripts").glob("*.sh"))
    assert "scripts/nemo_rl_env.sh" in scripts and len(scripts) >= 4, scripts
    r = subprocess.run([exe, "-x", *scripts], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("launcher", ["run_grpo", "run_sppo"])
def test_both_launchers_help_explains_the_overrides(launcher):
    r = subprocess.run(
        [sys.executable, "-m", f"nemo_granular.{launcher}", "--help"],
        capture_output=True,
        text=True,
        env=env_without_nemo_rl(),
        cwd=ROOT,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())
    assert OVERRIDES in text, text
    assert "[key=value ...]" in text.split("options:")[0], text  # in the usage line itself


@pytest.mark.parametrize("launcher", ["run_grpo", "run_sppo"])
def test_missing_nemo_rl_message_tells_the_install_story(launcher, tmp_path):
    cfg = tmp_path / "x.yaml"
    cfg.write_text("grpo: {}\n")
    r = subprocess.run(
        [sys.executable, "-m", f"nemo_granular.{launcher}", "--config", str(cfg)],
        capture_output=True,
        text=True,
        env=env_without_nemo_rl(),
        cwd=tmp_path,
        timeout=120,
    )
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "nemo_rl" in lines[0] and INSTALL in lines[0] and "docs/nemo-rl.md" in lines[0], lines[0]
    assert "PYTHONPATH" not in lines[0], lines[0]  # the documented story installs the package


def _section(text: str, number: int) -> str:
    return text.split(f"\n## {number}. ")[1].split("\n## ")[0]


def test_nemo_rl_doc_tells_the_install_story_of_the_readme():
    """§1's set-up installs the package (driver and CLI) and exports the checkout once for NeMo-RL's Ray
    workers; §2's launches follow §1 instead of telling a second, PYTHONPATH-only story."""
    doc = (ROOT / "docs" / "nemo-rl.md").read_text()
    readme = (ROOT / "README.md").read_text()
    s1, s2 = _section(doc, 1), _section(doc, 2)
    setup = s1.split("```bash")[1].split("```")[0]
    assert INSTALL in setup and "export PYTHONPATH=" in setup, setup
    launches = [b.split("```")[0] for b in s2.split("```bash")[1:]]
    assert launches and all("nemo_granular.run_" in b and "PYTHONPATH" not in b for b in launches), launches
    assert INSTALL in readme and "PYTHONPATH" in readme.split("## Using it")[0]  # the README says what it is for


def test_readme_says_how_long_the_full_demo_takes():
    """The quick start's duration is the one measured in the paragraph on how it was measured
    (a wall time and the machine's load), rounded to the minute."""
    quick = (ROOT / "README.md").read_text().split("## Using it")[0]
    said = re.search(r"full demo[^\n]*?(\d+) min", quick)
    assert said, "README's quick start gives no duration for the full demo"
    how = quick.split("**How long the full demo takes, and how that was measured.**")[1].split("\n\n")[0]
    measured = re.search(r"\*\*(\d+) min (\d+) s\*\* wall", how)
    assert measured and "load average" in how, how
    assert abs(int(said.group(1)) - (int(measured.group(1)) + int(measured.group(2)) / 60)) <= 0.5, (said, measured)


def test_readme_says_what_the_test_command_does_to_the_machine_before_the_command():
    """A reader who runs the quick start's commands as they come has read, before ``bash scripts/test.sh``,
    that it installs Slurm and edits /etc/hosts (as root)."""
    readme = (ROOT / "README.md").read_text()
    first_command = readme.index("\nbash scripts/test.sh")  # the command itself, at the start of a line
    before = readme[:first_command]
    for change in ("/etc/hosts", "slurmctld", "apt-", "root"):
        assert change in before, f"{change!r} is only said after the command"


def test_readme_quick_start_is_two_commands_and_names_the_tool_it_installs():
    quick = (ROOT / "README.md").read_text().split("## Quick start")[1].split("\n## ")[0]
    block = quick.split("```bash\n")[1].split("```")[0]
    commands = [line.split("#")[0].strip() for line in block.splitlines() if line.split("#")[0].strip()]
    assert commands == ["bash scripts/demo.sh", "bash scripts/test.sh"], commands
    assert ".venv/bin/nemo-granular" in quick  # the quick start does not put `nemo-granular` on PATH


def test_setup_venv_says_what_it_is_doing_before_the_slow_install(tmp_path):
    """scripts/setup_venv.sh printed nothing for a minute: a progress line comes before each install
    (here the script runs on a copy, with a pip that records when it is called)."""
    (tmp_path / "scripts").mkdir()
    for script in ("setup_venv.sh", "compile_venv.sh"):
        shutil.copy(ROOT / "scripts" / script, tmp_path / "scripts")
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    for name, body in (("pip", 'echo "PIP $*"\n'), ("python", "exit 0\n")):
        (bin_dir / name).write_text("#!/bin/sh\n" + body)
        (bin_dir / name).chmod(0o755)
    # one stream for the script's lines and pip's, in the order they were written
    r = subprocess.run(
        ["bash", "scripts/setup_venv.sh"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stdout
    lines = r.stdout.splitlines()
    pips = [i for i, line in enumerate(lines) if line.startswith("PIP ")]
    assert len(pips) == 2, lines
    assert lines[0].startswith("setup_venv: ") and "torch" in lines[0] and "minute" in lines[0], lines
    assert lines[pips[0] + 1].startswith("setup_venv: "), lines  # a line before the second install too
    assert lines[-1].startswith("setup_venv: done in ") and str(bin_dir / "nemo-granular") in lines[-1], lines
    again = subprocess.run(["bash", "scripts/setup_venv.sh"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and again.stderr == again.stdout == ""  # already set up: quiet


# a bare `python` (or `python3`) running this clone's benchmarks or the standalone commands: from a plain shell it
# has neither torch nor nemo_granular; the README's set-up puts both in .venv
BARE_PYTHON = re.compile(r"(?<![\w/.-])python3? +(benchmarks/\S+|-m nemo_granular (train|compare)\b)")


def test_documented_python_commands_use_the_venvs_interpreter():
    """docs/algorithms/offpolicy.md showed `python -m nemo_granular train ...` and `python benchmarks/...`, which
    fail from a plain shell (no torch, no nemo_granular outside .venv)."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    bare = [
        f"{p.relative_to(ROOT)}:{n}: {m.group(0)}"
        for p in pages
        for n, line in enumerate(p.read_text().splitlines(), 1)
        for m in BARE_PYTHON.finditer(line)
    ]
    assert not bare, "use .venv/bin/python (or .venv/bin/nemo-granular):\n" + "\n".join(bare)
    assert ".venv/bin/python benchmarks/offpolicy_study.py" in (ROOT / "docs/algorithms/offpolicy.md").read_text()
