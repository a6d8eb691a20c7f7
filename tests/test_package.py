"""The package imports with torch alone and exposes the plugin objects."""

import subprocess
import sys


def test_imports_without_optional_packages():
    code = (
        "import sys, nemo_granular as ng\n"
        "bad = [m for m in ('nemo_rl', 'ray', 'transformers', 'megatron', 'vllm') if m in sys.modules]\n"
        "assert not bad, bad\n"
        "assert ng.GranularPolicyLoss and ng.SequenceValueLoss and ng.build_advantage_estimator\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cli_help():
    out = subprocess.run([sys.executable, "-m", "nemo_granular", "--help"], capture_output=True, text=True, check=True)
    assert "train" in out.stdout and "export" in out.stdout


def test_every_cli_command_resolves():
    import importlib

    from nemo_granular.cli import COMMANDS

    for module, func, _ in COMMANDS.values():
        assert callable(getattr(importlib.import_module(module), func))
