"""The policy batch: every key of NeMo-RL's ``data`` the granular policy loss reads, declared once.

NeMo-RL calls a policy loss as ``loss_fn(next_token_logprobs=[B, S-1], data=..., ...)``. Per-token
keys are ``[B, S]`` indexed by token position and used as ``[:, 1:]`` against
``next_token_logprobs`` (the shift convention); per-sample keys are ``[B]``. :data:`POLICY_BATCH`
says, per key, its shape and dtype, whose key it is, when the loss reads it and whether the loss
refuses a call without it then. It is used by the loss (:func:`nemo_granular.losses.read_policy_batch`
reads these keys and no other), by the embedded trainer (which builds them,
``nemo_granular.embedded.trainer.BATCH_KEYS``) and by the tests' batch contract
(``tests/harness/contract.py``); ``tests/test_batch_schema.py`` fails when the loss reads a key this
table does not declare.

No imports from the package: every part may use it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BatchKey", "POLICY_BATCH", "LOSS_KEYS", "GUARANTEED_KEYS", "policy_key"]


@dataclass(frozen=True)
class BatchKey:
    """One key of the policy batch."""

    name: str
    shape: str  # "[B, S]" (per token, used as [:, 1:]), "[B, S-1]" (already next-token), "[B]" (per sample)
    dtype: str
    owner: str  # "NeMo-RL": NeMo-RL's own key; "ours": nemo_granular's driver computes it
    read_when: str  # when the loss reads it; "" when it never does (the hosts need it)
    required: bool  # the loss refuses a call without it where its config needs it (else it has a stand-in)
    guaranteed: bool  # every host sends it on every call (the batch contract checks it)
    meaning: str


POLICY_BATCH: tuple[BatchKey, ...] = (
    BatchKey(
        "token_mask",
        "[B, S]",
        "float or bool, 0/1",
        "NeMo-RL",
        "always",
        True,
        True,
        "the response tokens (column 0 is a prompt token: 0)",
    ),
    BatchKey(
        "sample_mask",
        "[B]",
        "float, 0/1",
        "NeMo-RL",
        "always",
        True,
        True,
        "the rows that count (0: padding rows of a microbatch)",
    ),
    BatchKey(
        "advantages",
        "[B, S]",
        "float",
        "NeMo-RL",
        "always",
        True,
        True,
        "A_it, usually one value per response broadcast to its tokens",
    ),
    BatchKey(
        "prev_logprobs",
        "[B, S]",
        "float",
        "NeMo-RL",
        "unless force_on_policy_ratio",
        True,
        True,
        "log π_old of each token",
    ),
    BatchKey(
        "generation_logprobs",
        "[B, S]",
        "float",
        "NeMo-RL",
        "when given",
        False,
        True,
        "log π_gen (the sampler's); absent: π_old stands in",
    ),
    BatchKey(
        "prev_entropy",
        "[B, S]",
        "float",
        "ours",
        "when given; the entropy clips and entropy groups need it",
        True,
        False,
        "π_old's full-vocabulary entropy, same shift",
    ),
    BatchKey(
        "granular_group_ids",
        "[B, S]",
        "int32",
        "ours",
        "segment and entropy groups, when given",
        False,
        False,
        "per-row local group ids 0..G-1, −1 outside the response (the loss reads int64 too); absent: "
        "computed in the loss",
    ),
    BatchKey(
        "input_ids",
        "[B, S]",
        "int64",
        "NeMo-RL",
        "segment groups without granular_group_ids",
        True,
        False,
        "the token ids, cut into segments at the delimiters",
    ),
    BatchKey(
        "reference_policy_logprobs",
        "[B, S]",
        "float",
        "NeMo-RL",
        "KL coefficient ≠ 0",
        True,
        False,
        "log π_ref, for the KL penalty",
    ),
    BatchKey(
        "curr_logprobs_unfiltered",
        "[B, S-1]",
        "float",
        "NeMo-RL",
        "KL coefficient ≠ 0, when given",
        False,
        False,
        "NeMo-RL's KL input (π_θ before top-k/top-p filtering); absent: next_token_logprobs",
    ),
    BatchKey(
        "rewards",
        "[B]",
        "float",
        "NeMo-RL",
        "positive_example_nll_weight > 0, when given",
        False,
        False,
        "the reward R_i; the NLL term on correct responses (R_i > 0) needs it",
    ),
    BatchKey(
        "input_lengths",
        "[B]",
        "int64",
        "NeMo-RL",
        "",
        False,
        False,
        "tokens per row; the hosts' microbatching and packing read it, the loss does not",
    ),
)

# the keys the loss reads (under some config)
LOSS_KEYS: tuple[str, ...] = tuple(k.name for k in POLICY_BATCH if k.read_when)
# the keys every policy-loss call carries, on every host
GUARANTEED_KEYS: tuple[str, ...] = tuple(k.name for k in POLICY_BATCH if k.guaranteed)


def policy_key(name: str) -> BatchKey:
    """The declaration of ``name`` (KeyError for a key the policy batch does not declare)."""
    for key in POLICY_BATCH:
        if key.name == name:
            return key
    raise KeyError(f"{name!r} is not a key of the policy batch (nemo_granular.batch_schema.POLICY_BATCH)")
