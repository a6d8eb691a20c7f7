"""The plugin's worker extensions run in the stock worker's built venv when there is one.

World: NeMo-RL (``nemo_rl_src``): its real actor-environment registry. NeMo-RL's image prefetches
the venvs of the classes in its registry under ``NEMO_RL_VENV_DIR`` (``/opt/ray_venvs``); a class it
does not know, registered with a ``uv run --extra mcore`` executable, gets one more venv of the same
extra built by ``create_local_venv_on_each_node`` on every node, in every new container (offline
nodes fail in ``setup()``). A registry value that is an interpreter path is used as is.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from nemo_granular.nemo_rl.workers import DTENSOR_V2_EXTENSION_FQN, MEGATRON_EXTENSION_FQN

pytestmark = pytest.mark.nemo_rl

MEGATRON_WORKER = "nemo_rl.models.policy.workers.megatron_policy_worker.MegatronPolicyWorker"


@pytest.fixture
def registry(nemo_rl_src, monkeypatch, tmp_path):
    from nemo_rl.distributed import ray_actor_environment_registry as reg

    saved = {
        k: reg.ACTOR_ENVIRONMENT_REGISTRY.pop(k)
        for k in (MEGATRON_EXTENSION_FQN, DTENSOR_V2_EXTENSION_FQN)
        if k in reg.ACTOR_ENVIRONMENT_REGISTRY
    }
    monkeypatch.setenv("NEMO_RL_VENV_DIR", str(tmp_path / "venvs"))
    yield reg
    for k in (MEGATRON_EXTENSION_FQN, DTENSOR_V2_EXTENSION_FQN):
        reg.ACTOR_ENVIRONMENT_REGISTRY.pop(k, None)
    reg.ACTOR_ENVIRONMENT_REGISTRY.update(saved)


def test_the_megatron_extension_reuses_the_stock_workers_built_venv(registry, tmp_path):
    from nemo_granular.nemo_rl.policy import register_worker_extensions
    from nemo_granular.preflight.venvs import venv_plan

    python = tmp_path / "venvs" / MEGATRON_WORKER / "bin" / "python"  # as the image prefetched it
    python.parent.mkdir(parents=True)
    python.symlink_to(sys.executable)
    register_worker_extensions()
    assert registry.get_actor_python_env(MEGATRON_EXTENSION_FQN) == str(python)
    # NeMo-RL's own worker-group rule: an executable that does not start with "uv" is used as is
    assert not registry.get_actor_python_env(MEGATRON_EXTENSION_FQN).startswith("uv")
    # the stock DTensor v2 worker's venv is not built here: that extension keeps NeMo-RL's executable
    assert (
        registry.get_actor_python_env(DTENSOR_V2_EXTENSION_FQN)
        == registry.ACTOR_ENVIRONMENT_REGISTRY[
            "nemo_rl.models.policy.workers.dtensor_policy_worker_v2.DTensorPolicyWorkerV2"
        ]
    )
    # and the preflight's plan: nothing to build for the extension
    [entry] = venv_plan([(MEGATRON_EXTENSION_FQN, "policy (nemo-granular worker extension)")])
    assert not entry.needs_venv and entry.py_executable == str(python)


def test_without_a_built_stock_venv_the_extension_gets_the_stock_workers_executable(registry):
    from nemo_granular.nemo_rl.policy import register_worker_extensions

    register_worker_extensions()
    stock = registry.ACTOR_ENVIRONMENT_REGISTRY[MEGATRON_WORKER]
    assert registry.get_actor_python_env(MEGATRON_EXTENSION_FQN) == stock and stock.startswith("uv")
    assert Path(registry.ACTOR_ENVIRONMENT_REGISTRY[MEGATRON_WORKER]) != Path(sys.executable)
