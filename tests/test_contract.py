"""One batch contract, checked on both hosts (and on the calls NeMo-RL's real wrappers make).

The same checker (`tests/harness/contract.py`) wraps the plugin loss (a) inside the embedded
trainer (tests/test_embedded.py::test_trainer_calls_plugin_with_nemo_rl_contract) and (b) here,
called the ways NeMo-RL's workers call it: whole microbatch, microbatch splits, and one call per
sequence as `SequencePackingLossWrapper` does (plain dict, rows sliced to their length).
"""

from __future__ import annotations

import pytest
import torch

from contract import ContractRecorder, check_policy_loss_call, check_value_loss_call
from nemo_granular import GranularPolicyLoss, SequenceValueLoss
from test_nemo_rl_loss_equivalence import _driver_batch, _microbatches, _per_sequence, _whole


@pytest.mark.parametrize("algorithm", ["grpo", "gspo", "sspo", "espo"])
@pytest.mark.parametrize("mode", [_whole, _microbatches, _per_sequence])
def test_nemo_rl_call_patterns_satisfy_the_contract(algorithm, mode):
    cfg = {"granular": {"algorithm": algorithm, "espo": {"vocab_size": 12}}}
    data, logp, gvs, gvt = _driver_batch(0, cfg)
    rec = ContractRecorder(GranularPolicyLoss(cfg), check_policy_loss_call)
    parts = mode(rec, logp, data, gvs, gvt)
    assert rec.calls == len(parts) >= 1


def test_contract_catches_a_wrong_shift():
    cfg = {"granular": {"algorithm": "sspo"}}
    data, logp, gvs, gvt = _driver_batch(0, cfg)
    with pytest.raises(AssertionError, match="width"):
        check_policy_loss_call(logp[:, :-1], data, gvs, gvt)  # logprobs not [B, S-1]
    bad = dict(data, prompt_ids=data["input_ids"][:, :4])  # a [B, Lp] tensor breaks NeMo-RL's shape rule
    with pytest.raises(AssertionError, match="prompt_ids"):
        check_policy_loss_call(logp, bad, gvs, gvt)
    with pytest.raises(AssertionError, match="global_valid_toks"):
        check_policy_loss_call(logp, data, gvs, gvt / 10)  # a microbatch-local count


def test_value_loss_contract_as_the_ppo_loop_calls_it():
    B, S = 4, 9
    token_mask = torch.zeros(B, S)
    token_mask[:, 3:7] = 1
    data = {
        "token_mask": token_mask,
        "sample_mask": torch.ones(B),
        "rewards": torch.tensor([1.0, 0, 1, 0]),
        "returns": token_mask * torch.tensor([1.0, 0, 1, 0])[:, None],
    }
    rec = ContractRecorder(SequenceValueLoss(), check_value_loss_call)
    values = torch.randn(B, S, 1, requires_grad=True)  # Megatron value head output [B, S, 1]
    loss, metrics = rec(
        logits=values, data=data, global_valid_seqs=torch.tensor(4.0), global_valid_toks=token_mask[:, 1:].sum()
    )
    loss.backward()
    assert rec.calls == 1 and values.grad[:, 3].abs().sum() > 0 and values.grad[:, 4:].abs().sum() == 0
    with pytest.raises(AssertionError, match="binary"):
        check_value_loss_call(values, dict(data, rewards=torch.tensor([0.5, 0, 1, 0])), 4.0, 4.0)


@pytest.mark.nemo_rl
@pytest.mark.parametrize("algorithm", ["grpo", "gspo", "sspo", "espo"])
def test_real_nemo_rl_call_paths_satisfy_the_contract(nemo_rl_src, monkeypatch, algorithm):
    """The calls NeMo-RL's REAL wrappers make (``prepare_loss_input`` per microbatch, and
    ``SequencePackingLossWrapper`` per packed sequence) satisfy the same contract."""
    from nemo_rl.algorithms.loss import prepare_loss_input
    from nemo_rl.algorithms.loss.wrapper import SequencePackingLossWrapper, wrap_loss_fn_with_input_preparation
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **k: self)  # single-device path, test only
    cfg = {"granular": {"algorithm": algorithm, "espo": {"vocab_size": 12}}}
    data, _, gvs, gvt = _driver_batch(0, cfg)
    B, S = data["input_ids"].shape
    logits = torch.randn(B, S, 12, generator=torch.Generator().manual_seed(1))
    rec = ContractRecorder(GranularPolicyLoss(cfg), check_policy_loss_call)
    for a, b in ((0, 4), (4, B)):
        wrap_loss_fn_with_input_preparation(
            logits[a:b],
            BatchedDataDict({k: v[a:b] for k, v in data.items()}),
            gvs,
            gvt,
            loss_fn=rec,
            prepare_fn=prepare_loss_input,
        )
    lengths = data["input_lengths"]
    cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).int()
    packed = torch.cat([logits[i, :L] for i, L in enumerate(lengths.tolist())])[None]
    SequencePackingLossWrapper(rec, prepare_loss_input, cu_seqlens_q=cu)(packed, BatchedDataDict(data), gvs, gvt)
    assert rec.calls == 2 + B
