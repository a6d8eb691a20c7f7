"""NeMo-RL's own loss tests pass with its ``ClippedPGLossFn`` replaced by the plugin's drop-in (issue #34 item 5).

World: NeMo-RL (``nemo_rl_src``), main and v0.7.0. ``tests/unit/algorithms/test_loss_functions.py`` of the
NeMo-RL checkout runs in a pytest of its own with ``-p nemo_rl_loss_substitute`` (``tests/harness``): every
``ClippedPGLossFn`` those tests construct is ``nemo_granular.losses.GranularPolicyLoss``, and their
``.to("cuda")`` runs on CPU (the stand-in of docs/nemo-rl.md §7). Deselected: the distillation tests (losses the
plugin does not replace; ``test_distillation_loss_different_settings[True-forward]`` fails on CPU with
NeMo-RL's own classes too). Every other test must pass, none skip, and the substitute must have been
constructed in exactly the tests whose source calls ``ClippedPGLossFn(`` (read from the file with ``ast``).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from conftest import ROOT

pytestmark = [pytest.mark.nemo_rl, pytest.mark.v070]

TESTS = "tests/unit/algorithms/test_loss_functions.py"


def _tests_constructing_clipped_pg(path) -> set[str]:
    """Names of the test functions and test methods whose body calls ``ClippedPGLossFn(...)``."""
    tree = ast.parse(path.read_text())
    tests = [
        f
        for node in tree.body
        for f in ([node] if isinstance(node, ast.FunctionDef) else node.body if isinstance(node, ast.ClassDef) else [])
        if isinstance(f, ast.FunctionDef) and f.name.startswith("test_")
    ]
    return {
        f.name
        for f in tests
        if any(isinstance(n, ast.Call) and getattr(n.func, "id", None) == "ClippedPGLossFn" for n in ast.walk(f))
    }


def test_nemo_rls_own_loss_tests_pass_with_the_plugin_substituted(nemo_rl_src, tmp_path):
    junit, record = tmp_path / "junit.xml", tmp_path / "constructed.json"
    env = dict(
        os.environ,
        PYTHONDONTWRITEBYTECODE="1",
        NEMO_GRANULAR_SUBSTITUTE_RECORD=str(record),
        PYTHONPATH=os.pathsep.join([str(ROOT / "tests" / "harness"), os.environ.get("PYTHONPATH", "")]),
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:xdist",
            "-p",
            "nemo_rl_loss_substitute",
            TESTS,
            "-k",
            "not distillation",
            f"--junitxml={junit}",
        ],
        cwd=nemo_rl_src,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert junit.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    cases = ET.parse(junit).getroot().iter("testcase")
    outcome = {
        c.get("name"): next((child.tag for child in c if child.tag in ("failure", "error", "skipped")), "passed")
        for c in cases
    }
    print(f"NeMo-RL's {TESTS}: {sum(v == 'passed' for v in outcome.values())} passed with the plugin substituted")
    assert outcome and all(v == "passed" for v in outcome.values()), (
        {k: v for k, v in outcome.items() if v != "passed"},
        proc.stdout[-3000:],
    )
    assert proc.returncode == 0, proc.stdout[-3000:]
    # the substitute ran where NeMo-RL's tests construct ClippedPGLossFn, and only there
    expected = _tests_constructing_clipped_pg(nemo_rl_src / TESTS)
    constructed = {name.split("[")[0] for name in json.loads(record.read_text())}
    assert len(expected) >= 10 and constructed == expected, sorted(expected ^ constructed)
