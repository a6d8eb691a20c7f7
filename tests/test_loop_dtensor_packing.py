"""The DTensor-v2 π_old pass with sequence packing ON (every shipped DTensor config packs), at TP 1 and TP 2.

Driver side (this process): the plugin's ``GranularPolicy._logprobs_and_entropy`` — NeMo-RL's
``Policy._shard_for_logprob`` (packed bins by NeMo-RL's packer, ``microbatch_order: packer``) and
``BatchedDataDict.from_batches`` + ``reorder_data`` — around a worker group whose call runs the
worker in a spawned gloo world (``cpu_host.packed_logprobs``: the real DTensor-v2 ``get_logprobs``
with NeMo-RL's ``pack_sequences`` / flash-attention kwargs and its packed ``LogprobsPostProcessor``,
our entropy subclass, a CPU stand-in for flash-attn's varlen kernel). π_old log-probs and entropy
must equal an unpacked transformers forward of the same weights, row by row (float64 reference).
"""

from __future__ import annotations

import pickle

import pytest
import torch

pytestmark = [pytest.mark.transformers_pin, pytest.mark.slow, pytest.mark.dist, pytest.mark.nemo_rl]
B, S = 9, 24
MB = 4  # logprob_batch_size; logprob_mb_tokens = S × MB


@pytest.fixture(scope="module")
def model_dir(nemo_rl_src, megatron_workers, tmp_path_factory):
    from cpu_host import models

    # peaked (scaled output layer): the entropy varies by nats across tokens, so a misplaced column shows
    return models.write_model(tmp_path_factory.mktemp("packed") / "qwen3", kv_heads=2, logit_scale=models.PEAKED)


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([24, 5, 17, 3, 11, 24, 8, 20, 2])
    ids = torch.zeros(B, S, dtype=torch.long)
    for i, n in enumerate(lengths.tolist()):
        ids[i, :n] = torch.randint(3, 32, (n,), generator=g)
    return ids, lengths


def _reference(model_dir, ids, lengths):
    """Unpacked transformers forward (its default attention), one row at a time; float64 softmax."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    lp, ent = torch.zeros(B, S, dtype=torch.float64), torch.zeros(B, S, dtype=torch.float64)
    with torch.no_grad():
        for i, n in enumerate(lengths.tolist()):
            logp = torch.log_softmax(hf(input_ids=ids[i : i + 1, :n]).logits[0].double(), -1)
            lp[i, 1:n] = logp[:-1].gather(-1, ids[i, 1:n, None]).squeeze(-1)
            ent[i, 1:n] = -(logp.exp() * logp).sum(-1)[:-1]
    return lp, ent


def _policy_cfg(tp: int, chunk):
    return {
        "logprob_batch_size": MB,
        "train_micro_batch_size": MB,
        "logprob_chunk_size": chunk,
        "make_sequence_length_divisible_by": tp,
        "dynamic_batching": {"enabled": False},
        "sequence_packing": {
            "enabled": True,
            "train_mb_tokens": S * MB,
            "logprob_mb_tokens": S * MB,
            "algorithm": "modified_first_fit_decreasing",
            "microbatch_order": "packer",
            "sequence_length_round": 8,
        },
    }


class _WorldGroup:
    """``RayWorkerGroup``'s two calls that ``GranularPolicy._logprobs_and_entropy`` makes, answered by
    one spawned gloo world of ``tp`` ranks (DP = 1: the TP ranks' outputs are replicas)."""

    def __init__(self, model_dir, tp, cfg):
        self.model_dir, self.tp, self.cfg, self.ranks = str(model_dir), tp, cfg, None

    def run_all_workers_sharded_data(self, method, *, data, in_sharded_axes, replicate_on_axes, output_is_replicated):
        from cpu_host.packed_logprobs import rank_logprobs
        from megatron_cpu.world import run_world

        assert method == "get_logprobs_with_entropy" and in_sharded_axes == ["data_parallel"]
        self.shards = list(data)
        self.ranks = run_world(
            self.tp,
            rank_logprobs,
            self.model_dir,
            pickle.dumps(self.shards),
            self.tp,
            self.cfg,
            env={"TORCHDYNAMO_DISABLE": "1", "HF_HUB_OFFLINE": "1"},
        )
        return [0]

    def shutdown(self, *args, **kwargs) -> bool:  # Policy.__del__ shuts its workers down
        return True

    def get_all_worker_results(self, futures):
        from nemo_rl.distributed.batched_data_dict import BatchedDataDict

        first = self.ranks[0]
        return [BatchedDataDict(logprobs=first["logprobs"], entropy=first["entropy"])]


def _packed_pass(model_dir, tp: int, chunk):
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict
    from nemo_rl.distributed.named_sharding import NamedSharding

    from nemo_granular.nemo_rl.policy import granular_policy_class

    cfg = _policy_cfg(tp, chunk)
    policy = granular_policy_class().__new__(granular_policy_class())
    pk = cfg["sequence_packing"]
    import numpy as np

    policy.__dict__.update(
        cfg=cfg,
        use_dynamic_batches=False,
        use_sequence_packing=True,
        sharding_annotations=NamedSharding(
            layout=np.arange(tp).reshape(1, 1, 1, tp),
            names=["pipeline_parallel", "data_parallel", "context_parallel", "tensor_parallel"],
        ),
        sequence_packing_args={
            "algorithm": pk["algorithm"],
            "input_key": "input_ids",
            "input_lengths_key": "input_lengths",
            "sequence_length_pad_multiple": tp,
            "microbatch_order": pk["microbatch_order"],
        },
        worker_group=_WorldGroup(model_dir, tp, cfg),
    )
    ids, lengths = _batch()
    out = policy._logprobs_and_entropy(BatchedDataDict(input_ids=ids, input_lengths=lengths))
    return policy.worker_group, out, ids, lengths


@pytest.mark.parametrize("tp,chunk", [(1, None), (2, 5)])
def test_packed_pi_old_logprobs_and_entropy_equal_the_unpacked_forward(model_dir, tp, chunk):
    group, out, ids, lengths = _packed_pass(model_dir, tp, chunk)
    # the worker ran packed: one packed row per bin, several bins, sequences reordered by the packer
    (shard,) = group.shards
    bins = [mb["input_lengths"].tolist() for mb in shard.make_microbatch_iterator_for_packable_sequences()]
    assert len(bins) >= 2 and sorted(sum(bins, [])) == sorted(lengths.tolist()), bins
    assert sum(bins, []) != lengths.tolist(), bins  # the packer reordered: the driver un-reorders
    rows = group.ranks[0]["attention_rows"]
    assert all(n == S * MB for n in rows), rows  # packed rows, padded to train_mb_tokens
    assert len(rows) == 2 * len(bins), (rows, bins)  # one packed row per bin, per layer (2)
    if tp > 1:  # every TP rank returned the same (replicated output)
        for r in group.ranks[1:]:
            assert torch.equal(r["logprobs"], group.ranks[0]["logprobs"])
            assert torch.equal(r["entropy"], group.ranks[0]["entropy"])
    ref_lp, ref_ent = _reference(model_dir, ids, lengths)
    lp, ent = out["logprobs"].double(), out["entropy"].double()
    assert lp.shape == ent.shape == (B, S)
    inside = (torch.arange(S)[None, :] >= 1) & (torch.arange(S)[None, :] < lengths[:, None])
    err_lp = float((lp - ref_lp).abs()[inside].max())
    err_ent = float((ent - ref_ent).abs()[inside].max())
    print(f"TP {tp}, chunk {chunk}: packed vs unpacked log-probs {err_lp:.3g}, entropy {err_ent:.3g}")
    assert err_lp <= 1e-5 and err_ent <= 1e-5, (err_lp, err_ent)  # measured ≤ 4.8e-6
    assert float(ent[~inside].abs().max()) == 0 and float(lp[~inside].abs().max()) == 0
    # the entropy differs across tokens: a misplaced column could not pass
    assert float(ref_ent[inside].max() - ref_ent[inside].min()) >= 1.0
