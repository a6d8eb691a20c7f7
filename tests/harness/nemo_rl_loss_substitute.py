"""pytest plugin (``-p nemo_rl_loss_substitute``) for NeMo-RL's own loss tests: its ``ClippedPGLossFn`` becomes the
plugin's drop-in ``nemo_granular.losses.GranularPolicyLoss``, and their ``.to("cuda")`` runs on CPU.

Used by ``tests/test_nemo_rl_own_loss_tests.py``. At configure time, before the test module is collected (it
imports ``ClippedPGLossFn`` from ``nemo_rl.algorithms.loss``):

* the CUDA → CPU stand-in of ``cpu_stand_ins.torch_cuda`` (docs/nemo-rl.md §7), and ``torch.cuda.is_available()``
  answering True once NeMo-RL's modules are imported (those tests skip without a GPU; answering True earlier
  makes torchao probe the device's properties while NeMo-RL imports it);
* ``ClippedPGLossFn`` in ``nemo_rl.algorithms.loss`` and its ``loss_functions`` module → ``GranularPolicyLoss``
  (``NEMO_GRANULAR_SUBSTITUTE=0`` leaves NeMo-RL's own, to compare).

``NEMO_GRANULAR_SUBSTITUTE_RECORD=FILE``: at the end, the tests during which a ``GranularPolicyLoss`` was
constructed, as JSON (so the caller can check that the substitute, not NeMo-RL's class, ran).
"""

from __future__ import annotations

import json
import os

_CURRENT: list[str] = [""]
_CONSTRUCTED: set[str] = set()


def pytest_configure(config):
    import torch

    from cpu_stand_ins import torch_cuda

    torch_cuda.install()
    import nemo_rl.algorithms.loss as loss_package
    import nemo_rl.algorithms.loss.loss_functions as loss_functions
    import nemo_rl.algorithms.x_token.loss_utils  # the test module imports these two: before is_available
    import nemo_rl.distributed.model_utils  # noqa: F401

    torch.cuda.is_available = lambda: True
    if os.environ.get("NEMO_GRANULAR_SUBSTITUTE", "1") != "1":
        return
    from nemo_granular.losses import GranularPolicyLoss

    real_init = GranularPolicyLoss.__init__

    def __init__(self, *args, **kwargs):
        _CONSTRUCTED.add(_CURRENT[0])
        real_init(self, *args, **kwargs)

    GranularPolicyLoss.__init__ = __init__
    loss_package.ClippedPGLossFn = GranularPolicyLoss
    loss_functions.ClippedPGLossFn = GranularPolicyLoss


def pytest_runtest_setup(item):
    _CURRENT[0] = item.name


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("NEMO_GRANULAR_SUBSTITUTE_RECORD")
    if path:
        with open(path, "w") as f:
            json.dump(sorted(_CONSTRUCTED), f)
