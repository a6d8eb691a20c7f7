"""The group index (docs/algorithms/math.md §2): one declared protocol, ``core.group_index.GroupIndex``,
and its three indexes — ``RowIndex`` (one group per row), ``FewGroupIndex`` (one-hot), ``ScatterIndex``
(scatter plan) — each implementing every member of it, with the same sums, gathers and counts as the
readable forms (``core.reference_forms.group_sum`` / ``gather_groups``) in float64."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from nemo_granular.core import reference_forms as F
from nemo_granular.core.group_index import FEW_GROUPS_MAX, FewGroupIndex, GroupIndex, RowIndex, make_group_index
from nemo_granular.core.scatter_index import ScatterIndex

F64 = torch.float64
ROOT = Path(__file__).resolve().parents[1]
PROTOCOL_MEMBERS = sorted(
    {*GroupIndex.__annotations__, *(n for n, v in vars(GroupIndex).items() if callable(v) and not n.startswith("_"))}
)


def _case(kind: str, seed: int = 0, B: int = 4, T: int = 11):
    """(ids, member, the index): rows of varying length, one row empty, one token with an id that
    is not a member (a non-finite token of the careful read)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([T, 0, 7, 4])
    inside = torch.arange(T)[None] < lengths[:, None]
    member = inside.to(F64)
    member[0, 2] = 0.0
    if kind == "row":
        ids = torch.where(inside, 0, -1)
        return ids, member, RowIndex(member), 1
    G = 3 if kind == "few" else 6
    ids = torch.where(inside, torch.randint(0, G, (B, T), generator=g), -1)
    index = FewGroupIndex(ids, G, F64, member=member) if kind == "few" else ScatterIndex.from_ids(ids, G, member=member)
    return ids, member, index, G


def test_the_protocol_declares_what_the_loss_calls():
    assert PROTOCOL_MEMBERS == [
        "B",
        "G",
        "T",
        "counts",
        "gather",
        "one_group_per_row",
        "prepare",
        "sum",
        "sum2",
        "sums",
    ]
    called = set()
    for rel in (
        "nemo_granular/losses.py",
        "nemo_granular/core/objective.py",
        "nemo_granular/core/offpolicy.py",
        "nemo_granular/loss_metrics.py",
    ):
        for node in ast.walk(ast.parse((ROOT / rel).read_text())):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in ("index", "idx", "mask_index")
            ):
                called.add(node.attr)
    assert called and called <= set(PROTOCOL_MEMBERS), sorted(called - set(PROTOCOL_MEMBERS))


@pytest.mark.parametrize("kind", ["row", "few", "scatter"])
def test_every_index_implements_the_whole_protocol(kind):
    _, _, index, _ = _case(kind)
    missing = [n for n in PROTOCOL_MEMBERS if not hasattr(index, n)]
    assert not missing, f"{type(index).__name__} lacks {missing}"
    assert index.one_group_per_row is (kind == "row")


@pytest.mark.parametrize("kind", ["row", "few", "scatter"])
def test_sums_gathers_and_counts_equal_the_readable_forms(kind):
    ids, member, index, G = _case(kind)
    ids_m = torch.where(member > 0, ids, -1)  # the members' ids: what the readable forms group by
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randn(ids.shape, generator=g, dtype=F64) for _ in range(2))
    xm, ym = x * member, y * member  # sum / sum2 take values that are 0 outside the members
    assert (index.B, index.T, index.G) == (*ids.shape, G)
    torch.testing.assert_close(index.sum(xm), F.group_sum(xm, ids_m, G), rtol=1e-14, atol=1e-14)
    for got, ref in zip(index.sum2(xm, ym), (xm, ym)):
        torch.testing.assert_close(got, F.group_sum(ref, ids_m, G), rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(index.counts(F64), F.group_count(ids_m, G, F64), rtol=0, atol=0)
    # sums reads the members itself: values outside them go to slot 0, a non-finite one shows there
    table = index.sums([x, y])
    assert table.shape == (ids.shape[0], G + 1, 2)
    for c, ref in enumerate((x, y)):
        torch.testing.assert_close(table[:, 1:, c], F.group_sum(ref, ids_m, G), rtol=1e-14, atol=1e-14)
        torch.testing.assert_close(table[:, 0, c], (ref * (ids_m < 0)).sum(-1), rtol=1e-14, atol=1e-14)
    x_inf = x.clone()
    x_inf[1, 0] = float("inf")  # a token in no group
    assert not torch.isfinite(index.sums([x_inf]).sum())
    per_group = torch.randn(ids.shape[0], G, generator=g, dtype=F64)
    gathered = index.gather(per_group)
    torch.testing.assert_close((gathered * member).expand_as(x), F.gather_groups(per_group, ids_m), rtol=0, atol=0)


def test_make_group_index_picks_by_the_number_of_groups():
    ids, member, _, _ = _case("scatter")
    assert isinstance(make_group_index(ids, FEW_GROUPS_MAX, F64, member), FewGroupIndex)
    assert isinstance(make_group_index(ids, FEW_GROUPS_MAX + 2, F64, member), ScatterIndex)


def test_the_loss_asks_the_index_not_its_class():
    """losses.py decides what an index can do from the protocol (``one_group_per_row``), not by
    ``isinstance`` against the index classes."""
    tree = ast.parse((ROOT / "nemo_granular/losses.py").read_text())
    classes = {"ScatterIndex", "FewGroupIndex", "RowIndex", "GroupIndex"}
    checks = [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and getattr(node.func, "id", None) == "isinstance"
        and classes & {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
    ]
    assert not checks, f"nemo_granular/losses.py: isinstance on a group index class at lines {checks}"
