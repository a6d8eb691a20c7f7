"""Batch arithmetic of one training step, and the batch checks NeMo-RL makes only at step 1.

``Policy.get_logprobs`` shards the rollout batch over DP, and ``Policy.train`` splits it into
``train_global_batch_size`` optimizer steps, each sharded over DP
(``nemo_rl/models/policy/lm_policy.py:_shard_for_logprob`` / ``_shard_for_train`` →
``nemo_rl/distributed/batched_data_dict.py:BatchedDataDict.shard_by_batch_size``); without
sequence packing or dynamic batching each worker then cuts its shard into micro-batches
(``BatchedDataDict.make_microbatch_iterator``). Each of those asserts divisibility — after the
first rollout, i.e. hours into a job.
"""

from __future__ import annotations

from collections.abc import Mapping

from .findings import Finding, error
from .layout import dig

__all__ = ["batch_plan", "batch_checks"]

SHARD = "nemo_rl/distributed/batched_data_dict.py:BatchedDataDict.shard_by_batch_size"
MICRO = "nemo_rl/distributed/batched_data_dict.py:BatchedDataDict.make_microbatch_iterator"


def batch_plan(cfg: Mapping, algo: str, section: str, dp: int) -> dict:
    """Rows per step, optimizer steps per rollout, rows per DP rank per optimizer step for ``section``
    (``policy`` or ``value``)."""
    part = cfg.get(section) or {}
    rows = int(dig(cfg, f"{algo}.num_prompts_per_step", 0)) * int(dig(cfg, f"{algo}.num_generations_per_prompt", 0))
    gbs = int(part.get("train_global_batch_size") or 0)
    mbs = int(part.get("train_micro_batch_size") or 0)
    epochs = int(dig(cfg, "ppo.ppo_epochs", 1) or 1) if algo == "ppo" else 1
    steps = (rows // gbs) * epochs if gbs else 0
    packed = bool(dig(part, "sequence_packing.enabled", False)) or bool(dig(part, "dynamic_batching.enabled", False))
    return dict(
        rows_per_step=rows,
        train_global_batch_size=gbs,
        train_micro_batch_size=mbs,
        logprob_batch_size=part.get("logprob_batch_size"),
        epochs=epochs,
        optimizer_steps_per_rollout=steps,
        rows_per_dp_rank=gbs // dp if dp and gbs else 0,
        dp=dp,
        packed=packed,
    )


def batch_checks(section: str, plan: dict) -> list[Finding]:
    rows, gbs, mbs, dp = (
        plan["rows_per_step"],
        plan["train_global_batch_size"],
        plan["train_micro_batch_size"],
        plan["dp"],
    )
    out: list[Finding] = []
    if not rows or not gbs or not dp:
        return out
    if rows % dp:
        out.append(
            error(
                SHARD,
                f"{section}: the {rows} rollout rows per step are not a multiple of DP {dp} "
                f"(get_logprobs shards them over DP)",
            )
        )
    if rows % gbs:
        out.append(
            error(
                SHARD,
                f"{section}: the {rows} rollout rows per step are not a multiple of "
                f"{section}.train_global_batch_size {gbs}",
            )
        )
    if gbs % dp:
        out.append(error(SHARD, f"{section}.train_global_batch_size {gbs} is not a multiple of DP {dp}"))
    elif not plan["packed"] and mbs and (gbs // dp) % mbs:
        out.append(
            error(
                MICRO,
                f"{section}: {gbs // dp} rows per DP rank per optimizer step are not a multiple of "
                f"{section}.train_micro_batch_size {mbs}",
            )
        )
    return out
