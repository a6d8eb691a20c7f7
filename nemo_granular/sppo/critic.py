"""Prompt-only, de-duplicated SPPO critic (docs/algorithms/math.md §7).

SPPO's critic V(s_p) depends on the prompt alone. NeMo-RL's value workers return values
**right-shifted by one** (``values[:, t] = head(t − 1)``; Megatron
``megatron_value_worker.py`` ``get_values`` / ``_value_loss_prepare_fn`` /
``_unpack_value_sequences``, DTensor ``dtensor_value_worker_v2.py`` ``right_shift_values`` /
``RightShiftLossWrapper``), so the head output at the last prompt token sits at column
``p = first response column`` (first 1 of ``token_mask``). Because attention is causal,
that number does not depend on the response: forwarding ``input_ids[:, :p + 1]`` (the
prompt plus one token, so that shifted column ``p`` exists) gives the same value as the
full ``[prompt | response]`` forward, at a fraction of the cost; identical prompts
(N > 1 samples per prompt) are forwarded once.

Pure functions (torch only, vectorised, no loops over rows or tokens):

* :func:`prompt_value_columns` — ``p_b`` per row from ``token_mask``.
* :func:`unique_prompt_index` / :func:`unique_prompts` — de-duplicate prompt rows, keeping
  first-occurrence order, for left- or right-padded prompt tensors (or explicit lengths).
* :func:`build_value_query_batch` — the short de-duplicated batch for ``get_values``.
* :func:`gather_prompt_values` / :func:`scatter_prompt_values` — read the short batch's
  values and put them back into a ``[B, S]`` tensor laid out like NeMo-RL's.
* :func:`build_value_train_batch` — the short batch for ``Value.train`` (one row per
  sample, see its docstring for why training is not de-duplicated).

:class:`PromptOnlyValue` wraps NeMo-RL's ``Value`` object with these functions.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..core.advantages import first_response_index
from .diagnostics import critic_diagnostics

__all__ = [
    "prompt_value_columns",
    "unique_prompt_index",
    "unique_prompts",
    "build_value_query_batch",
    "gather_prompt_values",
    "scatter_prompt_values",
    "build_value_train_batch",
    "PromptOnlyValue",
]


def _round_up(x: int, multiple: int) -> int:
    multiple = max(int(multiple), 1)
    return -(-int(x) // multiple) * multiple


# ----------------------------------------------------------------------------------------
# pure functions
# ----------------------------------------------------------------------------------------


def prompt_value_columns(token_mask: torch.Tensor, input_lengths: torch.Tensor | None = None) -> torch.Tensor:
    """Column ``p_b`` of NeMo-RL's right-shifted ``[B, S]`` values that holds V(s_prompt).

    ``p_b`` = index of the first 1 of ``token_mask[b]`` (= prompt length for a single-turn
    right-padded row). A row without any response token gets ``min(input_length, S) − 1``
    (its value is never used: such rows carry no advantage and no critic loss), which keeps
    ``p_b + 1 ≤ S``. Returns int64 ``[B]``.
    """
    if token_mask.dim() != 2:
        raise ValueError(f"token_mask must be [B, S], got shape {tuple(token_mask.shape)}")
    m = token_mask.bool()
    S = m.shape[1]
    first = first_response_index(m)
    if input_lengths is None:
        fallback = torch.full_like(first, max(S - 1, 0))
    else:
        fallback = input_lengths.to(first.device).long().clamp(1, max(S, 1)) - 1
    return torch.where(m.any(-1), first, fallback).long()


def _lengths_from_padding(prompt_ids: torch.Tensor, pad_id: int, padding_side: str) -> torch.Tensor:
    W = prompt_ids.shape[1]
    col = torch.arange(W, device=prompt_ids.device)
    real = prompt_ids != pad_id
    if padding_side == "right":  # last real token + 1 (pads only at the end are padding)
        return torch.where(real, col, torch.full_like(col, -1)).amax(-1).clamp_min(-1) + 1
    # left: first real token; everything before it is padding
    first = torch.where(real, col, torch.full_like(col, W)).amin(-1)
    return W - first


def _left_align(prompt_ids: torch.Tensor, lengths: torch.Tensor, padding_side: str) -> torch.Tensor:
    """Move each row's content to columns [0, len) (a no-op for right padding)."""
    if padding_side == "right":
        return prompt_ids
    W = prompt_ids.shape[1]
    col = torch.arange(W, device=prompt_ids.device)
    src = (col[None, :] + (W - lengths)[:, None]).clamp(max=W - 1)
    return prompt_ids.gather(1, src)


def _check_side(padding_side: str) -> None:
    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")


def unique_prompt_index(
    prompt_ids: torch.Tensor,
    pad_id: int | None = None,
    padding_side: str = "right",
    lengths: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """De-duplicate the prompt rows of ``prompt_ids`` ``[B, W]``, first-occurrence order.

    Two rows are the same prompt iff they have the same length and the same tokens within
    that length — independent of how much padding either row carries or on which side.
    ``lengths`` (``[B]``) overrides padding detection (use it when the pad id can also be a
    real token, or when columns past the prompt hold response tokens); otherwise
    ``pad_id`` + ``padding_side`` define the lengths: a right-padded row ends after its
    last non-pad token, a left-padded row starts at its first non-pad token.

    Returns ``(first_index [U], inverse [B], lengths [B])`` with
    ``prompt(b) == prompt(first_index[inverse[b]])``, ``first_index`` strictly increasing
    (unique prompts in order of first appearance) and ``inverse[first_index] == arange(U)``.
    """
    _check_side(padding_side)
    if prompt_ids.dim() != 2:
        raise ValueError(f"prompt_ids must be [B, W], got shape {tuple(prompt_ids.shape)}")
    B, W = prompt_ids.shape
    dev = prompt_ids.device
    if lengths is None:
        if pad_id is None:
            raise ValueError("unique_prompt_index needs pad_id or lengths")
        lengths = _lengths_from_padding(prompt_ids, int(pad_id), padding_side)
    lengths = lengths.to(dev).long().reshape(-1)
    if lengths.shape[0] != B:
        raise ValueError(f"lengths has {lengths.shape[0]} rows, prompt_ids has {B}")
    if B == 0:
        empty = torch.zeros(0, dtype=torch.long, device=dev)
        return empty, empty, lengths
    if bool((lengths < 0).any()) or bool((lengths > W).any()):
        raise ValueError(f"prompt lengths must lie in [0, {W}]")
    canon = _left_align(prompt_ids.long(), lengths, padding_side)
    col = torch.arange(W, device=dev)
    canon = torch.where(col[None, :] < lengths[:, None], canon, torch.full_like(canon, -1))
    key = torch.cat([lengths[:, None], canon], dim=1)
    _, inv = torch.unique(key, dim=0, return_inverse=True)  # sorted order
    U = int(inv.max()) + 1
    first = torch.full((U,), B, dtype=torch.long, device=dev).scatter_reduce(
        0, inv, torch.arange(B, device=dev), reduce="amin", include_self=True
    )
    order = torch.argsort(first)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(U, device=dev)
    return first[order], rank[inv], lengths


def unique_prompts(
    prompt_ids: torch.Tensor, pad_id: int, padding_side: str = "right", lengths: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unique prompts of ``prompt_ids`` ``[B, W]`` in first-occurrence order.

    Returns ``(unique_ids [U, W'], inverse [B])`` with ``unique_ids[inverse]`` equal to the
    prompts (same padding side, padded with ``pad_id``, width ``W'`` = the longest unique
    prompt). See :func:`unique_prompt_index` for how prompts are compared.
    """
    first, inverse, lens = unique_prompt_index(prompt_ids, pad_id, padding_side, lengths)
    ulens = lens[first]
    Wp = int(ulens.max()) if first.numel() else 0
    rows = _left_align(prompt_ids[first].long(), ulens, padding_side)[:, :Wp]
    col = torch.arange(Wp, device=prompt_ids.device)
    rows = torch.where(col[None, :] < ulens[:, None], rows, torch.full_like(rows, int(pad_id)))
    if padding_side == "left":  # right-align the content again
        src = (col[None, :] - (Wp - ulens)[:, None]).clamp(min=0)
        rows = torch.where(
            col[None, :] >= (Wp - ulens)[:, None], rows.gather(1, src), torch.full_like(rows, int(pad_id))
        )
    return rows.to(prompt_ids.dtype), inverse


def _short_rows(
    input_ids: torch.Tensor, rows: torch.Tensor, lengths: torch.Tensor, width: int, pad_id: int
) -> torch.Tensor:
    """``input_ids[rows, :lengths]`` right-padded with ``pad_id`` to ``width`` columns."""
    S = input_ids.shape[1]
    take = input_ids[rows, : min(width, S)]
    if width > S:
        take = torch.cat(
            [take, torch.full((take.shape[0], width - S), pad_id, dtype=take.dtype, device=take.device)], dim=1
        )
    col = torch.arange(width, device=input_ids.device)
    return torch.where(col[None, :] < lengths[:, None], take, torch.full_like(take, pad_id))


def build_value_query_batch(
    input_ids: torch.Tensor,
    value_cols: torch.Tensor,
    first_index: torch.Tensor,
    pad_id: int,
    pad_to_multiple: int = 1,
    rows_to_multiple: int = 1,
) -> dict:
    """Short, de-duplicated critic batch for ``Value.get_values``.

    Row ``u`` is ``input_ids[first_index[u], :p + 1]`` (prompt + its first response token,
    so that the right-shifted column ``p`` exists), right-padded with ``pad_id`` to the
    longest such row rounded up to ``pad_to_multiple`` (the value config's
    ``make_sequence_length_divisible_by``). Rows are appended (copies of row 0, their
    values are discarded) until the row count is a multiple of ``rows_to_multiple`` (the
    value model's DP size × inference micro-batch, which NeMo-RL's sharding asserts).

    Returns ``{"input_ids": [U', W], "input_lengths": [U'], "value_cols": [U'],
    "num_unique": U}``.
    """
    dev = input_ids.device
    first_index = first_index.to(dev).long()
    cols = value_cols.to(dev).long()[first_index]
    lens = cols + 1
    U = int(first_index.numel())
    if U == 0:
        raise ValueError("build_value_query_batch: empty batch")
    width = _round_up(int(lens.max()), pad_to_multiple)
    ids = _short_rows(input_ids, first_index, lens, width, int(pad_id))
    extra = (-U) % max(int(rows_to_multiple), 1)
    if extra:
        ids = torch.cat([ids, ids[:1].expand(extra, -1)], dim=0)
        lens = torch.cat([lens, lens[:1].expand(extra)])
        cols = torch.cat([cols, cols[:1].expand(extra)])
    return {"input_ids": ids, "input_lengths": lens, "value_cols": cols, "num_unique": U}


def gather_prompt_values(short_values: torch.Tensor, inverse: torch.Tensor, value_cols: torch.Tensor) -> torch.Tensor:
    """Per-sample critic logit ``v_b = short_values[inverse[b], value_cols[b]]`` → ``[B]``.

    ``short_values`` is the right-shifted ``[U', W']`` (or ``[U', W', 1]``) output of the
    critic on :func:`build_value_query_batch`'s rows.
    """
    sv = short_values.squeeze(-1) if short_values.dim() == 3 else short_values
    if sv.dim() != 2:
        raise ValueError(f"critic values must be [U, W] or [U, W, 1], got {tuple(short_values.shape)}")
    inverse = inverse.to(sv.device).long()
    value_cols = value_cols.to(sv.device).long()
    if bool((value_cols >= sv.shape[1]).any()):
        raise ValueError(f"critic returned {sv.shape[1]} columns but column {int(value_cols.max())} is needed")
    return sv[inverse, value_cols]


def scatter_prompt_values(per_sample: torch.Tensor, value_cols: torch.Tensor, seq_len: int) -> torch.Tensor:
    """``[B, S]`` values as NeMo-RL lays them out for SPPO: ``v_b`` at every column
    ``t ≥ p_b`` (the first response column and after — in the sequence-level bandit every
    response state has value V(s_p)), 0 in the prompt columns."""
    col = torch.arange(seq_len, device=per_sample.device)
    v = per_sample.float()
    return torch.where(col[None, :] >= value_cols.to(v.device)[:, None], v[:, None], torch.zeros_like(v)[:, None])


def build_value_train_batch(data: Mapping, value_cols: torch.Tensor, pad_id: int, pad_to_multiple: int = 1) -> dict:
    """Short critic **training** batch: one row per sample, prompt + 1 token.

    Keys: ``input_ids [B, W]``, ``input_lengths [B]`` (= p + 1), ``token_mask [B, W]``
    one-hot at ``p`` (all-zero for rows that had no response token, exactly like the full
    batch), ``sample_mask [B]``, ``rewards [B]`` (binary, per sample), ``returns [B, W]``
    (= token_mask · R; the Megatron value ``prepare_fn`` truncates the values to
    ``returns.shape[1]``) and, if present, ``values`` (old values at ``p``).

    Why training is NOT de-duplicated: (1) NeMo-RL's ``Value.train`` shards rows with
    ``shard_by_batch_size(dp, batch_size=train_global_batch_size)`` and asserts divisibility,
    so the row count must stay B (a data-dependent number of unique prompts would break it
    and padding back to B costs as much as one row per sample); (2) the BCE target stays
    the per-sample binary R, so accuracy/Brier metrics remain per sample and any code that
    checks R ∈ {0, 1} keeps working; (3) the intended SPPO setting is N = 1, where
    de-duplication would save nothing. (The mean-reward-with-count-weight alternative has
    the same BCE because BCE is linear in its target, but not the same accuracy metric.)
    The compute cut comes from the prompt-only width, which is what matters (p ≪ S).
    """
    ids = data["input_ids"]
    dev = ids.device
    B = ids.shape[0]
    cols = value_cols.to(dev).long()
    lens = cols + 1
    width = _round_up(int(lens.max()) if B else 1, pad_to_multiple)
    rows = torch.arange(B, device=dev)
    short = _short_rows(ids, rows, lens, width, int(pad_id))
    has_resp = data["token_mask"].to(dev).bool().any(-1)
    mask_dtype = data["token_mask"].dtype
    onehot = torch.nn.functional.one_hot(cols, width).to(mask_dtype) * has_resp[:, None].to(mask_dtype)
    rewards = data["rewards"].to(dev)
    out = {
        "input_ids": short,
        "input_lengths": lens.to(data["input_lengths"].dtype) if "input_lengths" in data else lens,
        "token_mask": onehot,
        "sample_mask": data["sample_mask"],
        "rewards": rewards,
        "returns": onehot.float() * rewards.float().reshape(-1, 1),
    }
    if "values" in data and data["values"] is not None:
        old = data["values"].to(dev).float()
        old = old.squeeze(-1) if old.dim() == 3 else old
        out["values"] = onehot.float() * old.gather(1, cols.clamp(max=old.shape[1] - 1)[:, None])
    return out


# ----------------------------------------------------------------------------------------
# wrapper around NeMo-RL's Value
# ----------------------------------------------------------------------------------------


def _batched(d: dict):
    """A NeMo-RL ``BatchedDataDict`` when NeMo-RL is importable, else a plain dict."""
    try:
        from ..nemo_rl.compat import get

        BatchedDataDict = get("BatchedDataDict")
    except Exception:  # noqa: BLE001 - without NeMo-RL a dict is all the inner object sees
        return dict(d)
    return BatchedDataDict(d)


class PromptOnlyValue:
    """Wrapper around NeMo-RL's ``Value`` (``nemo_rl/models/value/lm_value.py``) that makes
    the SPPO critic forward only the (unique) prompts.

    ``ppo_train`` uses ``prepare_for_inference, get_values, finish_inference,
    prepare_for_training, train, finish_training, save_checkpoint`` (+ ``shutdown`` in the
    async loop); all but ``get_values`` / ``train`` are forwarded unchanged, and every
    other attribute is looked up on the wrapped object.

    * ``get_values(data)``: builds :func:`build_value_query_batch` from the unique prompts,
      calls the inner ``get_values`` and returns ``{"values": [B, S]}`` laid out by
      :func:`scatter_prompt_values` (the logit V(s_p) at the first response column, as the
      full-sequence forward would have it). Also computes :func:`critic_diagnostics` on the
      critic's pre-update predictions vs this batch's rewards and hands them to
      ``logger.log_metrics(metrics, step, prefix=diagnostics_prefix)`` / ``on_metrics``.
    * ``train(data, loss_fn, ...)``: calls the inner ``train`` on
      :func:`build_value_train_batch` (one short row per sample).

    ``pad_to_multiple``: the value config's ``make_sequence_length_divisible_by``.
    ``rows_to_multiple``: row-count multiple for ``get_values``; ``None`` reads it from the
    inner object (DP size × inference micro-batch without packing / dynamic batching).
    """

    def __init__(
        self,
        inner: Any,
        pad_id: int,
        *,
        pad_to_multiple: int = 1,
        rows_to_multiple: int | None = None,
        dedup: bool = True,
        logger: Any = None,
        start_step: int = 0,
        diagnostics_prefix: str = "sppo_critic",
        on_metrics: Callable[[dict, int], None] | None = None,
    ):
        if pad_id is None:
            raise ValueError("PromptOnlyValue needs the tokenizer's pad_token_id (got None)")
        self.inner = inner
        self.pad_id = int(pad_id)
        self.pad_to_multiple = max(int(pad_to_multiple or 1), 1)
        self.rows_to_multiple = rows_to_multiple
        self.dedup = bool(dedup)
        self.logger = logger
        self.step = int(start_step)
        self.diagnostics_prefix = diagnostics_prefix
        self.on_metrics = on_metrics
        self.last_metrics: dict = {}

    # -- helpers -------------------------------------------------------------------------
    def _rows_multiple(self) -> int:
        if self.rows_to_multiple is not None:
            return max(int(self.rows_to_multiple), 1)
        inner = self.inner
        dp = 1
        ann = getattr(inner, "sharding_annotations", None)
        if ann is not None and hasattr(ann, "get_axis_size"):
            dp = int(ann.get_axis_size("data_parallel"))
        if getattr(inner, "use_dynamic_batches", False) or getattr(inner, "use_sequence_packing", False):
            return dp
        cfg = getattr(inner, "cfg", None) or {}
        mbs = cfg.get("logprob_batch_size") or cfg.get("train_micro_batch_size") or 1
        return dp * int(mbs)

    def _columns(self, data: Mapping) -> torch.Tensor:
        for key in ("input_ids", "token_mask"):
            if key not in data:
                raise KeyError(f"PromptOnlyValue: data[{key!r}] is missing")
        return prompt_value_columns(data["token_mask"], data.get("input_lengths"))

    # -- ValueInterface ------------------------------------------------------------------
    def get_values(self, data: Mapping, timer: Any = None, **kwargs):
        ids = data["input_ids"]
        B, S = ids.shape
        cols = self._columns(data)
        if self.dedup:
            first, inverse, _ = unique_prompt_index(ids, lengths=cols)
        else:
            first = inverse = torch.arange(B)
        q = build_value_query_batch(ids, cols, first, self.pad_id, self.pad_to_multiple, self._rows_multiple())
        query = _batched({"input_ids": q["input_ids"], "input_lengths": q["input_lengths"]})
        out = (
            self.inner.get_values(query, timer=timer, **kwargs)
            if (timer is not None or kwargs)
            else self.inner.get_values(query)
        )
        v = gather_prompt_values(out["values"], inverse, cols)
        result = _batched({"values": scatter_prompt_values(v, cols, S)})
        self._diagnose(data, v, inverse, q)
        return result

    def train(
        self,
        data: Mapping,
        loss_fn: Any,
        eval_mode: bool = False,
        *,
        gbs: int | None = None,
        mbs: int | None = None,
        timer: Any = None,
    ):
        cols = self._columns(data)
        short = _batched(build_value_train_batch(data, cols, self.pad_id, self.pad_to_multiple))
        return self.inner.train(short, loss_fn, eval_mode, gbs=gbs, mbs=mbs, timer=timer)

    def _diagnose(self, data: Mapping, v: torch.Tensor, inverse: torch.Tensor, q: dict) -> None:
        self.step += 1
        if "rewards" not in data:
            return
        w = data["token_mask"].bool().any(-1).float()
        if "sample_mask" in data:
            w = w * data["sample_mask"].float().reshape(-1)
        metrics = critic_diagnostics(v, data["rewards"], weights=w, group_ids=inverse)
        full_tokens = (
            float(data["input_lengths"].sum()) if "input_lengths" in data else float(data["input_ids"].numel())
        )
        metrics["rows_forwarded"] = float(q["num_unique"])
        metrics["rows_total"] = float(v.shape[0])
        metrics["token_fraction"] = float(q["input_lengths"][: q["num_unique"]].sum()) / max(full_tokens, 1.0)
        self.last_metrics = metrics
        if self.logger is not None:
            self.logger.log_metrics(metrics, self.step, prefix=self.diagnostics_prefix)
        if self.on_metrics is not None:
            self.on_metrics(metrics, self.step)

    def __getattr__(self, name: str):
        # everything else ppo_train calls (prepare_for_inference, finish_inference, prepare_for_training,
        # finish_training, save_checkpoint, shutdown, ...) goes to the wrapped Value unchanged.
        # Only reached when normal lookup fails; guard against recursion before __init__
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)
