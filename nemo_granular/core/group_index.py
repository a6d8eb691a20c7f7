"""The group index: how the loss sums per-token values over the ratio's groups and gathers per-group
values back to the tokens (docs/algorithms/math.md §2), declared once as :class:`GroupIndex`.

Three classes implement it; :func:`make_group_index` chooses among them for a batch's group ids:

* :class:`RowIndex` — one group per row (``sequence``): row sums, broadcasts, no scatter;
* :class:`FewGroupIndex` — up to :data:`FEW_GROUPS_MAX` groups per row (ESPO's entropy groups):
  a one-hot table, sums and gathers as batched products;
* :class:`~nemo_granular.core.scatter_index.ScatterIndex` — any number (SSPO's segments): a scatter plan.

Token groups (``token`` granularity) have no index: the loss passes ``None``.
"""

from __future__ import annotations

from typing import Protocol

import torch

from .scatter_index import ScatterIndex

__all__ = ["GroupIndex", "RowIndex", "FewGroupIndex", "FEW_GROUPS_MAX", "make_group_index"]


class GroupIndex(Protocol):
    """What the loss, its off-policy weights and its metrics call on a group index (``B`` rows, ``G``
    groups per row, ``T`` tokens per row). A token is a *member* of at most one group; the index
    knows which (ids −1 and tokens outside ``member`` are in no group).

    Values passed to :meth:`sum` / :meth:`sum2` must be 0 on the tokens in no group: a
    :class:`RowIndex` adds the whole row, the others drop those tokens. :meth:`sums` and
    :meth:`counts` read the members themselves (values there need not be 0)."""

    B: int
    G: int
    T: int
    # one group per row (RowIndex): the loss keeps its per-token path there (row sums and broadcasts
    # are already cheap) and computes the clipped objective per group (objective.grouped_clipped_objective)
    # on the other indexes
    one_group_per_row: bool

    def prepare(self) -> None:
        """Do now the work whose sizes depend on the ids' values (a host sync), so that the calls
        below need none: the loss calls it before a compiled objective (a no-op where there is none)."""
        ...

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """Σ of ``values`` ``[B, T]`` over each group's tokens, ``[B, G]`` (autograd flows)."""
        ...

    def sum2(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(:meth:`sum` of a, :meth:`sum` of b), in one pass where the index can."""
        ...

    def sums(self, channels: list[torch.Tensor]) -> torch.Tensor:
        """Σ over each group's members of C ``[B, T]`` channels (no autograd), ``[B, G + 1, C]``: slot 0
        of each row is the tokens in no group (up to rounding), so a non-finite value anywhere shows
        in the table."""
        ...

    def counts(self, dtype: torch.dtype) -> torch.Tensor:
        """Members per group, ``[B, G]`` in ``dtype``."""
        ...

    def gather(self, per_group: torch.Tensor) -> torch.Tensor:
        """Per-group values ``[B, G]`` to their tokens: ``[B, T]``, 0 on the tokens in no group (a
        :class:`RowIndex` returns ``[B, 1]``, which broadcasts to the row)."""
        ...


class RowIndex:
    """:class:`GroupIndex` of one group per row (``sequence`` granularity), whose members are ``member``
    (0/1 of the compute dtype, ``[B, T]``: the valid tokens). :meth:`sum` and :meth:`sum2` are row
    sums ``[B, 1]`` of the whole row — values must already be 0 outside the members (the loss's
    are; masking here would cost a full pass per call) — and :meth:`gather` is a broadcast (no
    scatter); :meth:`sums` and :meth:`counts` read ``member``."""

    one_group_per_row = True

    def __init__(self, member: torch.Tensor):
        self.B, self.T = member.shape
        self.G = 1
        self.member = member

    def prepare(self) -> None:
        pass

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        return values.sum(-1, keepdim=True)

    def sum2(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.sum(a), self.sum(b)

    def sums(self, channels: list[torch.Tensor]) -> torch.Tensor:
        """``[B, 2, C]``: slot 0 the tokens outside the members, slot 1 the row's group."""
        rows = torch.stack(channels, dim=1)  # [B, C, T]
        member = self.member[:, None, :]
        return torch.stack([(rows * (1 - member)).sum(-1), (rows * member).sum(-1)], dim=1)

    def counts(self, dtype: torch.dtype) -> torch.Tensor:
        return self.member.sum(-1, keepdim=True).to(dtype)

    def gather(self, per_group: torch.Tensor) -> torch.Tensor:
        return per_group


# up to this many groups per row :class:`FewGroupIndex` is used (ESPO: 2): on CPU a `scatter_add`
# of a [64, 4095] float32 tensor costs ~25 element-wise passes, the one-hot form ~2 per group
FEW_GROUPS_MAX = 4


class FewGroupIndex:
    """:class:`GroupIndex` for a few groups per row (ESPO's entropy
    groups), as a one-hot table O_igt = [id_it = g] ``[B, G, T]`` of the compute dtype:
    group sums Σ_t O_igt·x_it, gathers Σ_g O_igt·v_ig (exact: one term is v, the others 0·v).
    Ids must be in −1..G−1 (−1: no group: sums skip it, gathers read 0); ``member`` (0/1 of the
    compute dtype): the tokens that may belong to a group (the others count as id −1). Values
    summed and gathered must be finite (0·inf is NaN). The table has no row for the tokens of no
    group: :meth:`sums` gives them as the row's total minus its groups' (one pass over the
    channels instead of a third of the table's bytes, written once and read three times)."""

    one_group_per_row = False

    def __init__(
        self, group_ids: torch.Tensor, num_groups: int, dtype: torch.dtype, member: torch.Tensor | None = None
    ):
        self.B, self.T = group_ids.shape
        self.G = num_groups
        ids = group_ids.to(dtype).add_(1)  # small integers: exact in float (a float comparison is ~4x an int64 one)
        if member is not None:
            ids.mul_(member)  # 0: in no group
        cols = torch.arange(1, num_groups + 1, dtype=dtype, device=ids.device)
        self.onehot = torch.empty(self.B, num_groups, self.T, dtype=dtype, device=ids.device)
        torch.eq(ids[:, None, :], cols[None, :, None], out=self.onehot)

    def prepare(self) -> None:
        pass

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        return torch.mul(self.onehot, values[:, None, :]).sum(-1)

    def sums(self, channels: list[torch.Tensor]) -> torch.Tensor:
        """C channels at once, ``[B, G + 1, C]`` with the tokens of no group first (as
        :meth:`GroupIndex.sums`; here the row's total minus its groups', equal up to rounding and
        non-finite whenever a value is): one batched matmul and one row sum."""
        rows = torch.stack(channels, dim=1)  # [B, C, T]
        groups = torch.bmm(rows, self.onehot.transpose(1, 2))  # [B, C, G]
        rest = rows.sum(-1, keepdim=True).sub_(groups.sum(-1, keepdim=True))
        return torch.cat([rest, groups], dim=-1).transpose(1, 2)

    def counts(self, dtype: torch.dtype) -> torch.Tensor:
        """Tokens per group (its members), ``[B, G]`` in ``dtype``."""
        return self.onehot.sum(-1).to(dtype)

    def sum2(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.sum(a), self.sum(b)

    def gather(self, per_group: torch.Tensor) -> torch.Tensor:
        return torch.bmm(per_group[:, None, :], self.onehot).squeeze(1)  # tokens of no group: 0


def make_group_index(group_ids: torch.Tensor, num_groups: int, dtype: torch.dtype, member: torch.Tensor) -> GroupIndex:
    """The index of ``num_groups`` groups per row from ids >= −1 ``[B, T]`` whose members are ``member``
    (0/1 of ``dtype``: a token with an id but not a member is in no group): :class:`FewGroupIndex` up to
    :data:`FEW_GROUPS_MAX` groups, else :meth:`~nemo_granular.core.scatter_index.ScatterIndex.from_ids`."""
    if num_groups <= FEW_GROUPS_MAX:
        return FewGroupIndex(group_ids, num_groups, dtype, member=member)
    return ScatterIndex.from_ids(group_ids, num_groups, member=member)
