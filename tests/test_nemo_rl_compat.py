"""``nemo_granular.nemo_rl.compat``: every NeMo-RL name the plugin imports goes through it, each resolves
against the pinned NeMo-RL, and the NeMo-RL 0.8 locations are found when the old ones are gone.

World: NeMo-RL (``nemo_rl_src``; ``megatron_workers`` for the Megatron worker modules).
"""

from __future__ import annotations

import ast
import inspect
import sys
import types
from pathlib import Path

import pytest
import torch

from nemo_granular.nemo_rl import compat

PACKAGE = Path(__file__).resolve().parents[1] / "nemo_granular"


def _nemo_rl_imports(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "nemo_rl":
            out.append(f"from {node.module} import ...")
        elif isinstance(node, ast.Import):
            out += [f"import {a.name}" for a in node.names if a.name.split(".")[0] == "nemo_rl" and a.name != "nemo_rl"]
    return out


def test_the_package_imports_nemo_rl_only_through_compat():
    offenders = {str(p.relative_to(PACKAGE)): found for p in PACKAGE.rglob("*.py")
                 if p.name != "compat.py" and (found := _nemo_rl_imports(p))}
    assert offenders == {}


def test_every_name_and_module_resolves_against_the_pinned_nemo_rl(megatron_workers):
    import nemo_automodel.shared.import_utils as iu

    mp = pytest.MonkeyPatch()
    mp.setattr(iu, "safe_import_te", lambda: (False, None))  # TE-absent path (test only), as test_host_workers
    try:
        for short, full in compat.MODULES.items():
            if short == "grpo_sync":
                continue  # needs the data-plane extras; the estimators skip it the same way
            assert compat.module(short).__name__ == full
        for name, places in compat.LOCATIONS.items():
            obj = compat.get(name)
            assert obj is getattr(sys.modules[next(p for p in places if p in sys.modules
                                                   and hasattr(sys.modules[p], name))], name)
    finally:
        mp.undo()


def test_a_rebound_attribute_is_seen(nemo_rl_src, monkeypatch):
    import nemo_rl.data.utils as data_utils

    sentinel = object()
    monkeypatch.setattr(data_utils, "setup_response_data", sentinel)
    assert compat.get("setup_response_data") is sentinel     # looked up per call (tests rebind NeMo-RL's names)


def test_prepare_loss_input_found_where_nemo_rl_0_8_puts_it(nemo_rl_src, monkeypatch):
    import nemo_rl.algorithms.loss.utils as old

    def moved(*a, **k):
        return "0.8"

    monkeypatch.delattr(old, "prepare_loss_input")           # a NeMo-RL where it moved
    monkeypatch.setitem(sys.modules, "nemo_rl.algorithms.loss.loss_input",
                        types.SimpleNamespace(prepare_loss_input=moved))
    assert compat.get("prepare_loss_input") is moved
    monkeypatch.delitem(sys.modules, "nemo_rl.algorithms.loss.loss_input")
    with pytest.raises(ImportError, match="NeMo-RL has no 'prepare_loss_input' in nemo_rl.algorithms.loss.utils, "
                                          "nemo_rl.algorithms.loss.loss_input"):
        compat.get("prepare_loss_input")


def test_get_logprobs_keeps_the_0_8_token_mask(nemo_rl_src):
    """NeMo-RL 0.8's workers return ``token_mask`` next to the log-probs under top-k / top-p; the driver
    must write it back into the train batch, so ``GranularPolicy.get_logprobs`` hands it on."""
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    from nemo_granular.nemo_rl.policy import granular_policy_class

    cls = granular_policy_class()
    B, S = 3, 5
    worker_out = {"logprobs": torch.randn(B, S), "entropy": torch.rand(B, S),
                  "token_mask": torch.ones(B, S).tril()}

    class Group:
        def run_all_workers_sharded_data(self, method, **kw):
            assert method == "get_logprobs_with_entropy"
            return ["future"]

        def get_all_worker_results(self, futures):
            return [BatchedDataDict(dict(worker_out))]

        def shutdown(self, *a, **k):          # Policy.__del__ shuts its worker group down
            return True

    pol = cls.__new__(cls)
    pol.worker_group, pol._shard_for_logprob = Group(), lambda data: (data, None)
    data = BatchedDataDict(input_ids=torch.zeros(B, S, dtype=torch.long))
    out = pol.get_logprobs(data)
    assert sorted(out) == ["logprobs", "token_mask"] and torch.equal(out["token_mask"], worker_out["token_mask"])
    del worker_out["token_mask"]                               # 7ea279ab: logprobs only, as before
    assert sorted(pol.get_logprobs(data)) == ["logprobs"]
    # Policy.__init__'s newer keywords (0.8: is_refit_destination, reserved_http_server_ports) pass through
    params = inspect.signature(cls.__init__).parameters
    assert any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
