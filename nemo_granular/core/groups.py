"""Token groups: which tokens of a response share one importance ratio (docs/algorithms/math.md §1).

Every function takes per-token tensors of shape ``[B, T]`` (rows are responses) and a
boolean ``mask`` of the valid response tokens, and returns int64 ``group_ids`` of the same
shape: local ids ``0..G_i-1`` inside each row, ``-1`` outside the mask. Ids are contiguous
(no empty group), so ``group_ids.max(-1) + 1`` is the number of groups of a row. :func:`group_ids_for`,
what the hosts put into the batch as ``granular_group_ids``, returns them as :data:`GROUP_IDS_DTYPE`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from .masks import indicator

__all__ = [
    "token_group_ids",
    "sequence_group_ids",
    "segment_group_ids",
    "entropy_group_ids",
    "build_delimiter_table",
    "num_groups",
    "compact_group_ids",
    "group_ids_for",
    "GROUP_IDS_DTYPE",
]

# ``granular_group_ids`` as the hosts send them (nemo_granular.batch_schema): int32 halves the bytes the
# loss reads per call, and its float copy of them is ~4x cheaper to make than from int64 (measured in
# docs/benchmarks.md); the loss reads int64 ids too
GROUP_IDS_DTYPE = torch.int32


def token_group_ids(mask: torch.Tensor) -> torch.Tensor:
    """`token` granularity (GRPO, docs/algorithms/math.md §1): every valid token is its own group."""
    mask = mask.bool()
    ids = torch.cumsum(mask.long(), dim=-1) - 1
    return torch.where(mask, ids, -1)


def sequence_group_ids(mask: torch.Tensor) -> torch.Tensor:
    """`sequence` granularity (GSPO eq. 6, docs/algorithms/math.md §1): one group per response."""
    mask = mask.bool()
    return torch.where(mask, torch.zeros_like(mask, dtype=torch.long), -1)


def segment_group_ids(token_ids: torch.Tensor, mask: torch.Tensor, delimiter_table: torch.Tensor) -> torch.Tensor:
    """`segment` granularity (SSPO §4.1, docs/algorithms/math.md §1): cut after every delimiter token.

    ``delimiter_table[v]`` says whether token v's text contains a delimiter (built once by
    :func:`build_delimiter_table`). The delimiter token closes the segment it ends, tokens
    after the last delimiter form the last segment, and a response without a delimiter is a
    single segment. A gather plus an exclusive cumulative sum: no decode, no Python loop.
    """
    mask = mask.bool()
    table = delimiter_table.to(device=token_ids.device, dtype=torch.bool)
    ids = token_ids.long().clamp(0, table.numel() - 1)
    is_delimiter = (table[ids] & mask).long()
    # exclusive cumsum: the delimiter itself still belongs to the segment it closes
    seg = torch.cumsum(is_delimiter, dim=-1) - is_delimiter
    return torch.where(mask, seg, -1)


def entropy_group_ids(
    entropy: torch.Tensor,
    mask: torch.Tensor,
    top_fraction: float | Sequence[float] = 0.2,
    dtype: torch.dtype = torch.long,
) -> torch.Tensor:
    """`entropy_group` granularity (ESPO §3.4, §4.2; docs/algorithms/math.md §1).

    Tokens of a response are ranked by their own π_old entropy, highest first, ties broken
    by position (earlier first). With ``top_fraction=f`` the first ``ceil(f·n_i)`` tokens of
    row i form group 0 and the rest group 1. A list of increasing cut points
    ``[q_1, .., q_K]`` gives K+1 groups: token of rank r is in group #{k : r >= ceil(q_k·n_i)}.
    Groups need not be contiguous in position; empty groups are dropped (ids are compacted).
    Non-finite entropies must already be excluded from ``mask``. Ids in ``dtype`` (the loss takes
    them as floats, the hosts as :data:`GROUP_IDS_DTYPE`).

    No sort: per cut, rank >= k ⟺ H < thr, thr being the row's k-th largest H
    (:func:`_kth_largest`), unless H = thr is tied across the cut; then the first k − #(H > thr)
    tied tokens by position rank before it, as in a stable sort.
    """
    cuts = [float(top_fraction)] if isinstance(top_fraction, (int, float)) else [float(q) for q in top_fraction]
    mask = mask.bool()
    if entropy.shape[-1] == 0:
        return torch.full_like(mask, -1, dtype=dtype)
    key = torch.where(mask, entropy.float(), float("-inf"))  # a masked token never ranks
    n = mask.sum(-1, keepdim=True, dtype=torch.int32)  # int32: a bool sum to int64 is ~3x slower on CPU
    later = None  # per valid token, the number of (counted) cuts at or before its rank
    k_prev = torch.zeros_like(n)
    for q in cuts:  # loop over the (few) configured cut points, not over data
        k = torch.ceil(q * n.double() - 1e-9).to(n.dtype)  # 0 <= k_i <= n_i
        k_top = int(k.max())
        if k_top > 0:
            after = _rank_at_least(key, mask, k, k_top)
            if later is not None:
                # the group between the previous cut and this one is empty where k_prev == k: then this
                # cut does not count (ids stay contiguous); at the first cut k == 0 only in empty rows
                after.mul_(indicator(torch.gt, k, k_prev, after))
                after = later.add_(after)
            later = after
        k_prev = k
    if later is None:
        return torch.where(mask, 0, -1).to(dtype)
    return torch.where(mask, later.to(dtype), -1)


def _rank_at_least(key: torch.Tensor, mask: torch.Tensor, k: torch.Tensor, k_top: int) -> torch.Tensor:
    """0/1 floats: the valid token's rank (by ``key``, ties by position) is >= ``k`` of its row
    (anything outside ``mask``)."""
    thr = _kth_largest(key, mask, k, k_top)
    below = indicator(torch.lt, key, thr, key)  # masked keys (−inf) are below too
    if bool((below.sum(-1, keepdim=True) == key.shape[-1] - k).all()):  # no tie across the cut
        return below
    member = mask.to(key.dtype)
    above = indicator(torch.gt, key, thr, key)
    tied = indicator(torch.eq, key, thr, key).mul_(member)
    take = k - above.sum(-1, keepdim=True)  # the tied tokens that rank before the cut: first by position
    tied.mul_(indicator(torch.le, torch.cumsum(tied, -1), take, key))
    return member.sub_(above).sub_(tied)  # above and tied are disjoint members


def _kth_largest(key: torch.Tensor, mask: torch.Tensor, k: torch.Tensor, k_top: int) -> torch.Tensor:
    """Each row's ``k``-th largest key ``[B, 1]`` (+inf where k = 0), from one unsorted ``torch.topk``
    (a partial sort) of ``k_top`` = max k for every row: row i gets k_top − k_i keys of +inf first,
    in masked slots at its end when they are free (right padding), else in columns appended."""
    T = key.shape[-1]
    pads = torch.arange(k_top, 0, -1, device=key.device) <= (k_top - k)  # [B, k_top]: the row's last k_top − k_i
    tail = key[:, T - k_top :]
    if not bool((pads & mask[:, T - k_top :]).any()):
        kept = tail.clone()
        tail.masked_fill_(pads, float("inf"))
        thr = torch.topk(key, k_top, -1, sorted=False).values.amin(-1, keepdim=True)
        tail.copy_(kept)
        return thr
    padded = torch.cat([key, torch.where(pads, float("inf"), float("-inf"))], -1)
    return torch.topk(padded, k_top, -1, sorted=False).values.amin(-1, keepdim=True)


def compact_group_ids(group_ids: torch.Tensor, max_groups: int | None = None) -> torch.Tensor:
    """Renumber each row's group ids to 0..G_i-1, dropping empty groups (order kept)."""
    valid = group_ids >= 0
    if max_groups is None:
        max_groups = int(group_ids.max().item()) + 1 if valid.any() else 1
    B = group_ids.shape[0]
    present = torch.zeros(B, max_groups + 1, dtype=torch.long, device=group_ids.device)
    present.scatter_(-1, torch.where(valid, group_ids, max_groups), 1)
    present = present[:, :max_groups]
    new_id = torch.cumsum(present, -1) - 1
    mapped = torch.gather(new_id, -1, group_ids.clamp(min=0))
    return torch.where(valid, mapped, -1)


def num_groups(group_ids: torch.Tensor) -> torch.Tensor:
    """Number of (non-empty) groups per row, ``[B]`` int64 (0 for an empty row)."""
    if group_ids.shape[-1] == 0:
        return torch.zeros(group_ids.shape[0], dtype=torch.long, device=group_ids.device)
    return group_ids.max(dim=-1).values.clamp(min=-1) + 1


def build_delimiter_table(
    tokenizer, delimiters: Iterable[str] = ("\n\n",), vocab_size: int | None = None
) -> torch.Tensor:
    """Per-vocabulary lookup ``table[v] = any(d in text(v) for d in delimiters)``
    (docs/algorithms/math.md §1 Decision).

    Built once per tokenizer (one decode per vocabulary entry, at set-up time), so the hot
    path needs only a gather. ``vocab_size`` may exceed the tokenizer's (padded embedding
    tables); the extra ids are never delimiters.
    """
    delimiters = [d for d in delimiters]
    if not delimiters or any(not isinstance(d, str) or d == "" for d in delimiters):
        raise ValueError(f"segment_delimiters must be a non-empty list of non-empty strings, got {delimiters!r}")
    n_tok = len(tokenizer)
    size = max(n_tok, vocab_size or 0)
    texts = tokenizer.batch_decode(
        [[i] for i in range(n_tok)], skip_special_tokens=False, clean_up_tokenization_spaces=False
    )
    table = torch.zeros(size, dtype=torch.bool)
    hits = [i for i, text in enumerate(texts) if any(d in text for d in delimiters)]
    if hits:
        table[torch.tensor(hits, dtype=torch.long)] = True
    return table


def group_ids_for(
    granularity: str,
    mask: torch.Tensor,
    *,
    token_ids: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    delimiter_table: torch.Tensor | None = None,
    entropy_cut_points: float | Sequence[float] = 0.2,
    dtype: torch.dtype = GROUP_IDS_DTYPE,
) -> torch.Tensor:
    """Group ids of the configured granularity (dispatch over the four kinds of docs/algorithms/math.md §1),
    in ``dtype`` (:data:`GROUP_IDS_DTYPE`, as the hosts send them; the loss asks for its compute dtype)."""
    if granularity == "token":
        ids = token_group_ids(mask)
    elif granularity == "sequence":
        ids = sequence_group_ids(mask)
    elif granularity == "segment":
        if token_ids is None or delimiter_table is None:
            raise ValueError(
                "granularity 'segment' needs token ids and a delimiter table "
                "(pass a tokenizer, or precompute 'granular_group_ids')"
            )
        ids = segment_group_ids(token_ids, mask, delimiter_table)
    elif granularity == "entropy_group":
        if entropy is None:
            raise ValueError("granularity 'entropy_group' needs the π_old entropy ('prev_entropy')")
        return entropy_group_ids(entropy, mask.bool() & torch.isfinite(entropy), entropy_cut_points, dtype)
    else:
        raise ValueError(f"granularity: unknown value {granularity!r}")
    return ids.to(dtype)
