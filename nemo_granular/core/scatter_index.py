"""The scatter plan of a batch's groups: :class:`ScatterIndex`, the group index for many groups per
row (SSPO's segments), with one ``scatter_add`` per sum, run-wise sums of consecutive tokens, and
``index_select`` gathers (docs/algorithms/math.md §2; why these kernels: docs/benchmarks.md)."""

from __future__ import annotations

import torch

__all__ = ["ScatterIndex"]


class ScatterIndex:
    """Scatter/gather plan of per-row group ids ``[B, T]`` into a ``[B, G]`` table, built once: the
    :class:`~nemo_granular.core.group_index.GroupIndex` for any number of groups per row.

    Token (i, t) of group g maps to flat slot i·(G+1) + 1 + g; tokens with id −1 (and those
    ``mask`` excludes) map to the row's dummy slot i·(G+1), dropped by :meth:`sum` and read as 0
    by :meth:`gather`. Values may carry trailing channels (``[B, T, C]``).
    """

    one_group_per_row = False

    def __init__(self, group_ids: torch.Tensor, num_groups: int, mask: torch.Tensor | None = None):
        ids = group_ids.long()
        # member = (id >= 0) [& mask], as int64 0/1 (integer arithmetic: no bool temporaries)
        member = (ids + 1).clamp_(0, 1)
        if mask is not None:  # ``mask``: extra exclusions, bool or 0/1
            member.mul_(mask.to(torch.long) if mask.dtype != torch.bool else mask)
        self._build((ids + 1).mul_(member).sub_(1), num_groups)

    @classmethod
    def from_ids(cls, group_ids: torch.Tensor, num_groups: int, member: torch.Tensor | None = None) -> "ScatterIndex":
        """The plan for ids that are all >= −1 (the loss's own and the driver's): one integer add;
        ``member`` (0/1 floats): the tokens that may belong to a group (the others go to the dummy slot)."""
        self = cls.__new__(cls)
        if member is None:
            self._build(group_ids.long(), num_groups)
            return self
        B, T = group_ids.shape
        self.B, self.T, self.G = B, T, num_groups
        # slot = i·(G+1) + (id+1)·member, in floats (exact below 2^24, else float64): an int64 times
        # a bool or float mask costs ~20x a float multiply-add on CPU
        dt = member.dtype if B * (num_groups + 1) < 2**24 else torch.float64
        row = torch.arange(B, device=group_ids.device, dtype=dt).unsqueeze(-1) * (num_groups + 1)
        # two passes (addcmul: one for the product and the sum); the integer index is made only if a
        # scatter or a per-token gather needs it
        self._slot = torch.addcmul(row, group_ids.to(dt).add_(1), member).reshape(-1)
        self._flat = None
        return self

    @property
    def flat(self) -> torch.Tensor:
        """Slot of each token, int64 ``[B·T]``."""
        if self._flat is None:
            self._flat = self._slot.long()
        return self._flat

    @flat.setter
    def flat(self, value: torch.Tensor) -> None:
        self._flat = value

    def _few_runs(self) -> bool:
        """Runs long enough for the run-wise sums and gathers (a segment is one run)."""
        if getattr(self, "_few", None) is None:
            self._few = 4 * self.runs()[0].numel() <= self.B * self.T
        return self._few

    def prepare(self) -> None:
        """The runs, the choice between run sums and the scatter, and the gather's index, made now: their
        sizes depend on the ids' values (a host sync), so a compiled objective that uses the plan
        afterwards has no graph break (:class:`~nemo_granular.core.group_index.GroupIndex`)."""
        self._few_runs()
        self._gather_index()

    def _build(self, ids: torch.Tensor, num_groups: int) -> None:
        B, T = ids.shape
        self.B, self.T, self.G = B, T, num_groups
        row = torch.arange(B, device=ids.device).unsqueeze(-1) * (num_groups + 1) + 1
        self.flat = (ids + row).reshape(-1)  # id −1 -> the row's dummy slot

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """Σ over each group's tokens: ``[B, T, *C] -> [B, G, *C]`` (autograd flows)."""
        if values.dim() > 2:
            flat_c = values.reshape(self.B, self.T, -1)
            out = torch.stack([self.sum(flat_c[..., c]) for c in range(flat_c.shape[-1])], dim=-1)
            return out.view(self.B, self.G, *values.shape[2:])
        size = self.B * (self.G + 1)
        src = values.reshape(-1)
        buf = torch.zeros(size, dtype=values.dtype, device=values.device)
        # scatter_add: the fastest 1-D segmented sum on CPU (bincount with weights and
        # index_add are ~1.4x slower); out of place when autograd needs the graph
        flat = self.flat.long()  # (scatter takes int64 only; a no-op for the int64 plans)
        buf = buf.scatter_add(0, flat, src) if values.requires_grad else buf.scatter_add_(0, flat, src)
        return buf.view(self.B, self.G + 1)[:, 1:]

    def sums(self, channels: list[torch.Tensor]) -> torch.Tensor:
        """Σ over each group's tokens of C ``[B, T]`` channels (no autograd): ``[B, G + 1, C]``,
        slot 0 of each row the dummy slot (the tokens of no group), so a non-finite value anywhere
        shows in the table. Tokens are summed run by run (a run: consecutive tokens of one slot;
        a segment is one run) with ``segment_reduce``, ~3x cheaper than a ``scatter_add`` on CPU,
        and the runs' sums added into their slots; ids that change at almost every token fall
        back to one scatter per channel."""
        slots, lengths = self.runs()
        n_slots = self.B * (self.G + 1)
        if not self._few_runs():
            flat = self.flat.long()
            full = [
                torch.zeros(n_slots, dtype=c.dtype, device=c.device).scatter_add_(0, flat, c.reshape(-1))
                for c in channels
            ]
            return torch.stack(full, dim=-1).view(self.B, self.G + 1, len(channels))
        # unsafe: the lengths are the runs' own (no check of them per channel)
        run_sums = torch.stack(
            [torch.segment_reduce(c.reshape(-1), "sum", lengths=lengths, unsafe=True) for c in channels], -1
        )
        table = torch.zeros(n_slots, len(channels), dtype=run_sums.dtype, device=run_sums.device)
        return table.index_add_(0, slots, run_sums).view(self.B, self.G + 1, len(channels))

    def runs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(slot of each run, its length): the plan's runs of consecutive tokens in one slot."""
        if getattr(self, "_runs", None) is None:
            # on the gather's index (int32 where the slots fit, cheaper to compare than floats)
            values, lengths = torch.unique_consecutive(self._gather_index(), return_counts=True)
            self._runs = (values.long(), lengths)
        return self._runs

    def counts(self, dtype: torch.dtype) -> torch.Tensor:
        """Tokens per group (its members), ``[B, G]`` in ``dtype``."""
        slots, lengths = self.runs()
        table = torch.zeros(self.B * (self.G + 1), dtype=torch.long, device=slots.device)
        return table.index_add_(0, slots, lengths).view(self.B, self.G + 1)[:, 1:].to(dtype)

    def sum2(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(Σa, Σb) per group with one scatter, a and b packed as the real and imaginary parts
        of one complex tensor (no autograd; a complex scatter costs what a real one does)."""
        if a.dtype not in (torch.float32, torch.float64) or a.dtype != b.dtype or a.requires_grad or b.requires_grad:
            return self.sum(a), self.sum(b)
        both = self.sum(torch.complex(a, b))
        return both.real, both.imag

    def gather(self, per_group: torch.Tensor) -> torch.Tensor:
        """Per-group values to tokens: ``[B, G, *C] -> [B, T, *C]``, 0 outside any group."""
        if per_group.dim() > 2:
            flat_c = per_group.reshape(self.B, self.G, -1)
            out = torch.stack([self.gather(flat_c[..., c]) for c in range(flat_c.shape[-1])], dim=-1)
            return out.view(self.B, self.T, *per_group.shape[2:])
        pad = torch.zeros(self.B, 1, dtype=per_group.dtype, device=per_group.device)
        table = torch.cat([pad, per_group], dim=1).reshape(-1)
        return table.index_select(0, self._gather_index()).view(self.B, self.T)

    def _gather_index(self) -> torch.Tensor:
        """The slots as the index of :meth:`gather`: int32 where they fit (index_select takes it;
        ~4x cheaper to make than int64 on CPU), else :attr:`flat`."""
        if self._flat is not None or getattr(self, "_slot", None) is None or self.B * (self.G + 1) >= 2**31:
            return self.flat
        if getattr(self, "_flat32", None) is None:
            self._flat32 = self._slot.int()
        return self._flat32
