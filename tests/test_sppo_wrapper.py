"""PromptOnlyValue on a REAL transformers critic (tiny Qwen3 + per-token value head, random init).

``LocalValue`` below stands in for NeMo-RL's ``Value`` on one process. It follows the
conventions read in NeMo-RL's source (commit 7ea279ab) — it is the environment, not the
thing under test:

* ``get_values``: per-token head output, right-shifted by one (``values[:, t] = head(t-1)``,
  ``megatron_value_worker.py`` get_values / ``dtensor_value_worker_v2.py`` right_shift_values),
  row count must divide into DP shards of whole inference micro-batches
  (``shard_by_batch_size`` / ``make_microbatch_iterator`` asserts);
* ``train``: global batches of ``train_global_batch_size`` rows, ``global_valid_seqs =
  Σ sample_mask``, ``global_valid_toks = Σ token_mask[:, 1:]·sample_mask`` per global batch
  (``process_global_batch``), micro-batches of ``mbs`` rows, and the backend's shift:
  Megatron ``_value_loss_prepare_fn`` (squeeze, shift, truncate to ``data["returns"].shape[1]``)
  or DTensor ``RightShiftLossWrapper`` (shift the ``[B, S, 1]`` logits).
"""

from __future__ import annotations

import copy
import types

import pytest
import torch

from nemo_granular.losses import SequenceValueLoss
from nemo_granular.sppo.critic import PromptOnlyValue, prompt_value_columns
from nemo_granular.sppo.install import install_sppo_estimator

pytestmark = pytest.mark.v070

transformers = pytest.importorskip("transformers")

PAD = 0
VOCAB = 50


def tiny_critic(seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        num_labels=1,
        pad_token_id=PAD,
        classifier_dropout=0.0,
    )  # the token-classification head has dropout 0.1 by default
    model = transformers.Qwen3ForTokenClassification(cfg).float()
    model.score.weight.data.normal_(0, 1.0)  # make the head output O(1)
    return model.eval()


class _Sharding:
    def __init__(self, dp):
        self.dp = dp

    def get_axis_size(self, name):
        return self.dp if name == "data_parallel" else 1


class LocalValue:
    """Single-process stand-in for nemo_rl.models.value.lm_value.Value (see module docstring)."""

    def __init__(self, model, backend="dtensor", dp=1, lbs=2, gbs=4, mbs=2, lr=0.5):
        self.model, self.backend = model, backend
        self.sharding_annotations = _Sharding(dp)
        self.cfg = {"logprob_batch_size": lbs, "train_global_batch_size": gbs, "train_micro_batch_size": mbs}
        self.opt = torch.optim.SGD(self.model.parameters(), lr=lr)
        self.calls: list = []
        self.shapes: list = []

    def _head(self, ids, lengths):
        col = torch.arange(ids.shape[1])
        attn = (col[None, :] < lengths.reshape(-1, 1)).long()
        return self.model(input_ids=ids, attention_mask=attn).logits  # [B, S, 1]

    def get_values(self, data, timer=None):
        ids = data["input_ids"]
        B = ids.shape[0]
        dp, lbs = self.sharding_annotations.dp, self.cfg["logprob_batch_size"]
        assert B % dp == 0, f"Batch size ({B}) is not a multiple of shards ({dp})"
        assert (B // dp) % lbs == 0, f"Data dict size ({B // dp}) is not a multiple of the microbatch size ({lbs})"
        self.calls.append("get_values")
        self.shapes.append(tuple(ids.shape))
        with torch.no_grad():
            v = self._head(ids, data["input_lengths"]).squeeze(-1)
        return {"values": torch.cat([torch.zeros_like(v[:, :1]), v[:, :-1]], dim=1)}

    def train(self, data, loss_fn, eval_mode=False, *, gbs=None, mbs=None, timer=None):
        gbs = gbs or self.cfg["train_global_batch_size"]
        mbs = mbs or self.cfg["train_micro_batch_size"]
        B = data["input_ids"].shape[0]
        assert B % gbs == 0, f"Total batch size ({B}) is not a multiple of batch_size ({gbs})"
        self.calls.append("train")
        self.shapes.append(tuple(data["input_ids"].shape))
        self.model.train()
        metrics: dict = {}
        losses = []
        for g in range(B // gbs):
            gb = {k: v[g * gbs : (g + 1) * gbs] for k, v in data.items()}
            gvs = gb["sample_mask"].sum()
            gvt = (gb["token_mask"][:, 1:] * gb["sample_mask"][:, None]).sum()
            self.opt.zero_grad()
            total = 0.0
            for m in range(gbs // mbs):
                mb = {k: v[m * mbs : (m + 1) * mbs] for k, v in gb.items()}
                logits = self._head(mb["input_ids"], mb["input_lengths"])
                if self.backend == "megatron":
                    v = logits.squeeze(-1)
                    v = torch.cat([torch.zeros_like(v[:, :1]), v[:, :-1]], dim=1)[:, : mb["returns"].shape[1]]
                else:
                    v = torch.cat([torch.zeros_like(logits[:, :1]), logits[:, :-1]], dim=1)
                loss, mm = loss_fn(logits=v, data=mb, global_valid_seqs=gvs, global_valid_toks=gvt)
                if not eval_mode:
                    loss.backward()
                total += float(loss.detach())
                for k, val in mm.items():
                    metrics.setdefault(k, []).append(val)
            if not eval_mode:
                self.opt.step()
            losses.append(total)
        self.model.eval()
        return {"loss": torch.tensor(losses), "grad_norm": torch.tensor(0.0), "all_mb_metrics": metrics}

    def __getattr__(self, name):
        if name in {
            "prepare_for_inference",
            "finish_inference",
            "prepare_for_training",
            "finish_training",
            "save_checkpoint",
            "shutdown",
        }:
            return lambda *a, **k: self.calls.append(name)
        raise AttributeError(name)


def make_batch(seed=1, n_per_prompt=2, divisible_by=4):
    """train_data as ppo_train builds it: right-padded [prompt | response], token_mask on the
    response, binary rewards; prompts of different lengths, each sampled ``n_per_prompt`` times."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, VOCAB, (int(L),), generator=g) for L in (5, 3, 7, 4)]
    rows, masks = [], []
    for p in prompts:
        for _ in range(n_per_prompt):
            r = torch.randint(1, VOCAB, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g)
            rows.append(torch.cat([p, r]))
            masks.append(torch.cat([torch.zeros(len(p)), torch.ones(len(r))]))
    S = -(-max(len(r) for r in rows) // divisible_by) * divisible_by
    ids = torch.full((len(rows), S), PAD, dtype=torch.long)
    tm = torch.zeros(len(rows), S)
    for i, (r, m) in enumerate(zip(rows, masks)):
        ids[i, : len(r)] = r
        tm[i, : len(m)] = m
    B = len(rows)
    return {
        "input_ids": ids,
        "input_lengths": torch.tensor([len(r) for r in rows]),
        "generation_logprobs": torch.zeros(B, S),
        "rewards": torch.randint(0, 2, (B,), generator=g).float(),
        "token_mask": tm,
        "sample_mask": torch.ones(B),
    }


def test_prompt_only_values_equal_full_sequence_read():
    data = make_batch()
    model = tiny_critic()
    full = LocalValue(model).get_values(data)["values"]
    cols = prompt_value_columns(data["token_mask"], data["input_lengths"])
    v_full = full.gather(1, cols[:, None]).squeeze(1)
    inner = LocalValue(model)
    wrapped = PromptOnlyValue(inner, PAD, pad_to_multiple=4)
    out = wrapped.get_values(data)["values"]
    assert out.shape == full.shape
    v_short = out.gather(1, cols[:, None]).squeeze(1)
    assert float((v_short - v_full).abs().max()) <= 1e-5
    assert float(v_full.abs().max()) > 0.1  # a real signal, not zeros
    # the critic saw 4 unique prompts (8 samples), prompt + 1 token wide, padded to a multiple of 4
    assert inner.shapes == [(4, 8)] and full.shape[1] >= 12
    # after p the row holds v (bandit value); the prompt columns are 0
    col = torch.arange(full.shape[1])
    assert torch.equal(out, torch.where(col[None] >= cols[:, None], v_short[:, None], torch.zeros(())))


def test_without_dedup_every_sample_is_forwarded():
    data = make_batch()
    inner = LocalValue(tiny_critic())
    out = PromptOnlyValue(inner, PAD, dedup=False).get_values(data)["values"]
    dedup = PromptOnlyValue(LocalValue(inner.model), PAD).get_values(data)["values"]
    assert inner.shapes[0][0] == 8 and float((out - dedup).abs().max()) <= 1e-5


def test_query_rows_padded_to_dp_times_microbatch():
    data = make_batch(n_per_prompt=3)
    data = {k: v[:9] for k, v in data.items()}  # 3 unique prompts
    inner = LocalValue(tiny_critic(), dp=2, lbs=2)
    PromptOnlyValue(inner, PAD).get_values(data)
    assert inner.shapes[0][0] == 4


@pytest.mark.parametrize("backend", ["megatron", "dtensor"])
def test_short_training_batch_matches_full_training(backend):
    data = make_batch(seed=3)
    data["sample_mask"][5] = 0.0  # a filtered sample (overlong) carries no loss
    base = tiny_critic(seed=4)
    full_v = LocalValue(copy.deepcopy(base), backend=backend, gbs=4, mbs=2)
    short_inner = LocalValue(copy.deepcopy(base), backend=backend, gbs=4, mbs=2)
    wrapped = PromptOnlyValue(short_inner, PAD, pad_to_multiple=2)
    cols = prompt_value_columns(data["token_mask"], data["input_lengths"])
    full_data = dict(data, returns=data["token_mask"] * data["rewards"][:, None])
    r_full = full_v.train(full_data, SequenceValueLoss())
    r_short = wrapped.train(data, SequenceValueLoss())
    assert short_inner.shapes[-1] == (8, -(-(int(cols.max()) + 1) // 2) * 2)  # one short row per sample
    assert torch.allclose(r_full["loss"], r_short["loss"], atol=1e-6)
    for k in ("bce", "acc", "brier", "values_mean", "returns_mean", "num_valid_samples"):
        assert sum(r_full["all_mb_metrics"][k]) == pytest.approx(sum(r_short["all_mb_metrics"][k]), abs=1e-5), k
    assert sum(r_full["all_mb_metrics"]["num_valid_samples"]) == 7
    # two SGD steps (2 global batches) took both critics to the same parameters
    for (n, a), b in zip(full_v.model.named_parameters(), short_inner.model.parameters()):
        assert float((a - b).detach().abs().max()) <= 1e-5, n
    assert any(
        float((a - b).detach().abs().max()) > 1e-4 for a, b in zip(base.parameters(), short_inner.model.parameters())
    )


class _Logger:
    def __init__(self):
        self.logged = []

    def log_metrics(self, metrics, step, prefix=""):
        self.logged.append((prefix, step, dict(metrics)))


def test_ppo_train_step_sequence_with_patched_estimator():
    """The calls ppo_train makes (nemo_rl/algorithms/ppo.py:1514-1627), in order, on the wrapper."""
    data = make_batch(seed=5, n_per_prompt=2)
    model = tiny_critic(seed=6)
    ref = LocalValue(copy.deepcopy(model)).get_values(data)["values"]

    def original(master_config):
        raise ValueError(f"Invalid adv_estimator name for PPO: {master_config.ppo.adv_estimator['name']!r}")

    ppo_module = types.ModuleType("ppo_like")
    ppo_module._create_advantage_estimator = original
    restore = install_sppo_estimator(ppo_module)
    master_config = types.SimpleNamespace(
        ppo=types.SimpleNamespace(adv_estimator={"name": "sppo", "gae_lambda": 0.95, "gae_gamma": 1.0}), loss_fn={}
    )
    logger = _Logger()
    inner = LocalValue(model, backend="megatron")
    value_model = PromptOnlyValue(inner, PAD, logger=logger, start_step=10)
    adv_estimator = ppo_module._create_advantage_estimator(master_config)

    train_data = dict(data)
    value_model.prepare_for_inference()
    values = value_model.get_values(train_data)
    train_data["values"] = values["values"].squeeze(-1)
    value_model.finish_inference()
    advantage_mask = train_data["token_mask"] * train_data["sample_mask"].unsqueeze(-1)
    advantages, returns = adv_estimator.compute_advantage(
        prompt_ids=data["input_ids"],
        rewards=train_data["rewards"],
        mask=advantage_mask,
        reference_logprobs=None,
        logprobs=torch.zeros_like(advantage_mask),
        values=train_data["values"],
    )
    train_data["advantages"], train_data["returns"] = advantages, returns
    value_model.prepare_for_training()
    results = value_model.train(train_data, SequenceValueLoss(), timer=None)
    value_model.finish_training()
    value_model.save_checkpoint("w", optimizer_path="o")

    cols = prompt_value_columns(data["token_mask"], data["input_lengths"])
    v = ref.gather(1, cols[:, None]).squeeze(1)
    expect = (data["rewards"] - torch.sigmoid(v))[:, None] * advantage_mask
    assert float((advantages - expect).abs().max()) <= 1e-5
    assert torch.equal(returns, data["rewards"][:, None] * advantage_mask)
    assert inner.calls == [
        "prepare_for_inference",
        "get_values",
        "finish_inference",
        "prepare_for_training",
        "train",
        "finish_training",
        "save_checkpoint",
    ]
    assert results["all_mb_metrics"]["num_valid_samples"] and results["loss"].numel() == 2
    # diagnostics: logged once, at step start_step + 1, pre-update predictions vs rewards, 4 prompts x 2
    ((prefix, step, m),) = logger.logged
    assert prefix == "sppo_critic" and step == 11
    assert m["num_prompts_multi"] == 4 and m["rows_forwarded"] == 4 and m["rows_total"] == 8
    assert m["value_mean"] == pytest.approx(float(torch.sigmoid(v).mean()), abs=1e-6)
    assert 0 < m["token_fraction"] < 0.5
    restore()
    with pytest.raises(ValueError, match="Invalid adv_estimator"):
        ppo_module._create_advantage_estimator(master_config)


@pytest.mark.nemo_rl
def test_prompt_only_value_inside_real_value_get_values(nemo_rl_src):
    """``PromptOnlyValue`` around NeMo-RL's REAL ``Value.get_values`` (DP = 2: the real
    ``BatchedDataDict.shard_by_batch_size``, ``run_all_workers_sharded_data`` keywords,
    ``from_batches``); each worker shard is answered by the tiny critic as a value worker would.
    3 unique prompts: the query rows must be padded to a DP multiple or the real sharding refuses."""
    import inspect

    from nemo_rl.distributed.batched_data_dict import BatchedDataDict
    from nemo_rl.distributed.worker_groups import RayWorkerGroup
    from nemo_rl.models.value.lm_value import Value

    model = tiny_critic()
    worker = LocalValue(model)

    class Group:
        def run_all_workers_sharded_data(self, method_name, *args, **kwargs):
            inspect.signature(RayWorkerGroup.run_all_workers_sharded_data).bind(None, method_name, *args, **kwargs)
            assert method_name == "get_values" and hasattr(Value, method_name)
            return [getattr(worker, method_name)(dict(shard)) for shard in kwargs["data"]]

        def get_all_worker_results(self, futures):
            return [BatchedDataDict(f) for f in futures]

        def shutdown(self, cleanup_method=None):  # Value.__del__ calls it
            return True

    value = object.__new__(Value)
    value.sharding_annotations = _Sharding(2)
    value.use_dynamic_batches = value.use_sequence_packing = False
    value.cfg = {"logprob_batch_size": 1, "train_micro_batch_size": 1}
    value.worker_group = Group()

    data = make_batch(n_per_prompt=3)
    data = {k: v[:9] for k, v in data.items()}  # 3 unique prompts, 9 samples
    out = PromptOnlyValue(value, PAD).get_values(BatchedDataDict(data))["values"]
    full = LocalValue(model, lbs=1).get_values(data)["values"]
    cols = prompt_value_columns(data["token_mask"], data["input_lengths"])
    v_full = full.gather(1, cols[:, None]).squeeze(1)
    v_out = out.gather(1, cols[:, None]).squeeze(1)
    assert float((v_out - v_full).abs().max()) <= 1e-5 and float(v_full.abs().max()) > 0.1
    assert worker.shapes and all(s[0] == 2 for s in worker.shapes)  # 4 query rows (3 + 1 pad) over DP 2
