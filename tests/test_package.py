"""The package imports with torch alone and exposes the plugin objects.

Worlds: the first three tests run in whichever world the suite runs in (they must hold in
both); the ``nemo_rl_src`` tests run with the real NeMo-RL checkout importable.
"""

import subprocess
import sys

import pytest

from conftest import env_without_nemo_rl

pytestmark = pytest.mark.v070

HEAVY = ("nemo_rl", "ray", "transformers", "megatron", "vllm", "mlflow", "torchao")


def test_imports_without_optional_packages():
    """World without NeMo-RL (forced in the subprocess)."""
    code = (
        "import sys, nemo_granular as ng\n"
        f"bad = [m for m in {HEAVY!r} if m in sys.modules]\n"
        "assert not bad, bad\n"
        "assert ng.GranularPolicyLoss and ng.SequenceValueLoss and ng.build_advantage_estimator\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env=env_without_nemo_rl())


def test_cli_help():
    out = subprocess.run([sys.executable, "-m", "nemo_granular", "--help"], capture_output=True, text=True, check=True)
    assert "train" in out.stdout and "export" in out.stdout


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "--config", "/nonexistent/grpo.yaml"],
        ["train", "--config", "examples/configs/local/grpo.yaml", "rl.no_such_key=1"],
        ["compare", "--algorithms", "grpo,,sspo"],
        ["export", "/nonexistent/run", "/tmp/nemo-granular-test-hf-unused"],
        ["eval-checkpoints", "/nonexistent/run", "--suite", "sspo"],
    ],
    ids=lambda a: "-".join(a[:2]),
)
def test_bad_input_is_refused_before_torch_is_imported(argv):
    """A mistyped command answers at once (issue #36: errors took 1.5-8 s, torch loaded before validation;
    ``import nemo_granular`` imported it for its public names, which are now imported on first use)."""
    from pathlib import Path

    code = (
        "import sys\nfrom nemo_granular import cli\nrc = cli.main(sys.argv[1:])\n"
        "print('torch imported' if 'torch' in sys.modules else 'no torch', file=sys.stderr)\nsys.exit(rc)"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[1],
    )
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 2 and lines[-1] == "no torch", r.stderr


def test_every_cli_command_resolves():
    import importlib

    from nemo_granular.cli import COMMANDS

    for module, func, _ in COMMANDS.values():
        assert callable(getattr(importlib.import_module(module), func))


@pytest.mark.nemo_rl
def test_import_does_not_load_nemo_rl_training_stack(nemo_rl_src):
    """NeMo-RL world (issue 15.1): with NeMo-RL importable, ``import nemo_granular`` (and the
    losses) must not run ``nemo_rl/algorithms/loss/__init__.py`` (Ray, transformers, mlflow)."""
    code = (
        "import sys, nemo_granular as ng\n"
        "from nemo_granular.losses import GranularPolicyLoss\n"
        "import nemo_rl.utils  # NeMo-RL itself is importable here\n"
        "GranularPolicyLoss({'granular': {'algorithm': 'sspo'}})\n"
        f"bad = [m for m in {HEAVY[1:]!r} + ('nemo_rl.algorithms.loss', 'nemo_rl.algorithms') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stderr == "", proc.stderr[-2000:]  # no foreign log lines
    cli = subprocess.run([sys.executable, "-m", "nemo_granular", "--help"], capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0 and cli.stderr == "", cli.stderr[-2000:]


@pytest.mark.nemo_rl
def test_local_enums_hold_in_nemo_rl_code_paths(nemo_rl_src):
    """NeMo-RL world: the loss is built BEFORE NeMo-RL's loss package is imported (local enums),
    then NeMo-RL's own code compares them: ``prepare_loss_input`` dispatches on ``input_type``,
    ``prepare_packed_loss_input`` refuses a non-LOGPROB loss, dict look-ups by host member; once
    NeMo-RL's module is loaded every member the losses hand out IS NeMo-RL's own (the Megatron
    worker compares with ``is``), before and after a Ray-style pickle round trip."""
    code = r"""
import pickle, torch
torch.Tensor.cuda = lambda self, *a, **k: self  # CPU shim: NeMo-RL moves ids with .cuda()
from nemo_granular.losses import GranularPolicyLoss, SequenceValueLoss
from nemo_granular import protocol
assert not protocol.USING_HOST_ENUMS
pol = GranularPolicyLoss({'granular': {'algorithm': 'grpo'}})
val = SequenceValueLoss()
from nemo_rl.algorithms.loss.interfaces import LossInputType, LossType
from nemo_granular.nemo_rl import compat
MetricNormalizer = compat.find('MetricNormalizer')  # main only (v0.7.0 has no split-step rescale)
from nemo_rl.algorithms.loss.utils import prepare_loss_input, prepare_packed_loss_input
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
assert type(protocol.LossInputType.LOGPROB) is not LossInputType  # the module's own enums are local
assert type(pol.input_type) is LossInputType and type(pol.loss_type) is LossType  # resolved when read
assert pol.loss_type == LossType.TOKEN_LEVEL and LossType.TOKEN_LEVEL == pol.loss_type
assert pol.loss_type != LossType.SEQUENCE_LEVEL and val.loss_type == LossType.SEQUENCE_LEVEL
assert {LossType.TOKEN_LEVEL: 'tok'}[pol.loss_type] == 'tok'
g = torch.Generator().manual_seed(0)
logits = torch.randn(2, 5, 11, generator=g)
data = BatchedDataDict({'input_ids': torch.randint(0, 11, (2, 5), generator=g),
                        'token_mask': torch.ones(2, 5), 'sample_mask': torch.ones(2)})
inp, _ = prepare_loss_input(logits, data, pol)
ref = torch.log_softmax(logits.double(), -1)[:, :-1].gather(-1, data['input_ids'][:, 1:, None])[..., 0]
assert set(inp) == {'next_token_logprobs'}, inp.keys()
torch.testing.assert_close(inp['next_token_logprobs'].double(), ref, rtol=1e-5, atol=1e-5)
inp, _ = prepare_loss_input(logits, data, val)
assert set(inp) == {'logits'}
try:
    prepare_packed_loss_input(logits, data, val, cu_seqlens_q=None, cu_seqlens_q_padded=None)
except ValueError as err:
    assert 'only supports LossInputType.LOGPROB' in str(err)
else:
    raise AssertionError('LOGIT loss accepted by the packed LOGPROB path')
for loss in (pol, val):
    clone = pickle.loads(pickle.dumps(loss))
    assert clone.loss_type is loss.loss_type and clone.input_type is loss.input_type
    kinds = set(clone.metric_normalizations.values())
    MN = MetricNormalizer or protocol.MetricNormalizer   # v0.7.0: the local enum stands in
    assert kinds and all(type(k) is MN for k in kinds), kinds
    assert clone.metric_normalizations['loss'] is (MN.TOKENS if loss is pol else MN.SEQUENCES)
    assert clone.metric_normalizations['num_valid_samples'] is MN.NONE
print('ok')
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
