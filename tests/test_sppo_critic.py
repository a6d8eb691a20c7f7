"""Pure prompt de-duplication / short-batch / scatter functions of nemo_granular.sppo.critic."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nemo_granular.sppo.critic import (
    build_value_query_batch,
    build_value_train_batch,
    gather_prompt_values,
    prompt_value_columns,
    scatter_prompt_values,
    unique_prompt_index,
    unique_prompts,
)

PAD = 0


def _right(rows, width=None):
    width = width or max(len(r) for r in rows)
    return torch.tensor([r + [PAD] * (width - len(r)) for r in rows])


def _left(rows, width=None):
    width = width or max(len(r) for r in rows)
    return torch.tensor([[PAD] * (width - len(r)) + r for r in rows])


PROMPTS = [[5, 6], [7], [5, 6], [7, 8, 9], [7], [5, 6, 1]]


@pytest.mark.parametrize("side", ["right", "left"])
def test_unique_prompts_first_occurrence_order(side):
    ids = (_right if side == "right" else _left)(PROMPTS, width=6)
    uniq, inv = unique_prompts(ids, PAD, side)
    assert inv.tolist() == [0, 1, 0, 2, 1, 3]
    expect = (_right if side == "right" else _left)([[5, 6], [7], [7, 8, 9], [5, 6, 1]])
    assert torch.equal(uniq, expect)


def test_unique_prompts_ignores_padding_amount_and_side_of_each_row():
    # the same prompt padded to different widths is one prompt; [5, 6] and [5, 6, 1] are not
    a = _right([[5, 6], [5, 6, 1]], width=3)
    b = _right([[5, 6]], width=3)
    ids = torch.cat([a, b])
    first, inv, lens = unique_prompt_index(ids, PAD, "right")
    assert first.tolist() == [0, 1] and inv.tolist() == [0, 1, 0] and lens.tolist() == [2, 3, 2]


def test_explicit_lengths_allow_pad_id_inside_prompts_and_response_tokens_after():
    # pad id 0 is a real token of row 0/2, and columns past the prompt hold response tokens
    ids = torch.tensor([[3, 0, 9, 9], [3, 0, 4, 4], [3, 0, 1, 2], [3, 4, 4, 4]])
    lengths = torch.tensor([2, 3, 2, 2])
    first, inv, _ = unique_prompt_index(ids, lengths=lengths)
    assert first.tolist() == [0, 1, 3] and inv.tolist() == [0, 1, 0, 2]


def test_bad_inputs_raise_one_line_errors():
    with pytest.raises(ValueError, match="padding_side"):
        unique_prompts(torch.zeros(2, 3, dtype=torch.long), PAD, "middle")
    with pytest.raises(ValueError, match="pad_id or lengths"):
        unique_prompt_index(torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="lengths"):
        unique_prompt_index(torch.zeros(2, 3, dtype=torch.long), lengths=torch.tensor([1, 4]))


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.lists(st.integers(1, 4), min_size=1, max_size=4), min_size=1, max_size=5),
    st.lists(st.integers(0, 4), min_size=12, max_size=12),
    st.sampled_from(["left", "right"]),
    st.integers(0, 3),
)
def test_dedup_property(pool, picks, side, extra_width):
    rows = [pool[i % len(pool)] for i in picks]
    width = max(len(r) for r in rows) + extra_width
    ids = (_right if side == "right" else _left)(rows, width)
    uniq, inv = unique_prompts(ids, PAD, side)
    first, inv2, _ = unique_prompt_index(ids, PAD, side)
    assert torch.equal(inv, inv2)
    # reference: python first-occurrence dedup
    seen: dict = {}
    ref_inv = [seen.setdefault(tuple(r), len(seen)) for r in rows]
    assert inv.tolist() == ref_inv
    assert [list(k) for k in seen] == [[t for t in u if t != PAD] for u in uniq.tolist()]
    assert torch.equal(inv[first], torch.arange(len(seen)))
    assert bool((first[1:] > first[:-1]).all())


def test_prompt_value_columns():
    tm = torch.tensor([[0, 0, 1, 1, 0], [0, 1, 1, 1, 1], [0, 0, 0, 0, 0], [0, 0, 1, 0, 1]])
    assert prompt_value_columns(tm, torch.tensor([4, 5, 3, 5])).tolist() == [2, 1, 2, 2]
    assert prompt_value_columns(tm).tolist() == [2, 1, 4, 2]


def test_query_batch_shapes_padding_and_row_multiple():
    ids = torch.tensor([[5, 6, 10, 11, 0], [7, 12, 13, 0, 0], [5, 6, 14, 0, 0]])
    cols = torch.tensor([2, 1, 2])
    first, inv, _ = unique_prompt_index(ids, lengths=cols)
    q = build_value_query_batch(ids, cols, first, PAD, pad_to_multiple=4, rows_to_multiple=3)
    assert q["num_unique"] == 2
    assert q["input_ids"].tolist() == [[5, 6, 10, 0], [7, 12, 0, 0], [5, 6, 10, 0]]
    assert q["input_lengths"].tolist() == [3, 2, 3] and q["value_cols"].tolist() == [2, 1, 2]
    # shifted critic output of the short batch: column c holds "value of prompt" = 10*row + c
    short = torch.arange(3)[:, None] * 10.0 + torch.arange(4)[None, :]
    v = gather_prompt_values(short[..., None], inv, cols)
    assert v.tolist() == [2.0, 11.0, 2.0]
    full = scatter_prompt_values(v, cols, 5)
    assert full.tolist() == [[0, 0, 2, 2, 2], [0, 11, 11, 11, 11], [0, 0, 2, 2, 2]]
    with pytest.raises(ValueError, match="columns"):
        gather_prompt_values(short[:, :2], inv, cols)


def test_train_batch_one_row_per_sample_binary_targets():
    ids = torch.tensor([[5, 6, 10, 11, 0], [7, 12, 13, 0, 0], [5, 6, 14, 0, 0], [5, 6, 0, 0, 0]])
    tm = torch.tensor([[0, 0, 1, 1, 0], [0, 1, 1, 0, 0], [0, 0, 1, 0, 0], [0, 0, 0, 0, 0]])
    data = {
        "input_ids": ids,
        "input_lengths": torch.tensor([4, 3, 3, 2]),
        "token_mask": tm,
        "sample_mask": torch.tensor([1.0, 1.0, 0.0, 1.0]),
        "rewards": torch.tensor([1.0, 0.0, 1.0, 0.0]),
        "values": torch.arange(20.0).reshape(4, 5),
    }
    cols = prompt_value_columns(tm, data["input_lengths"])
    b = build_value_train_batch(data, cols, PAD, pad_to_multiple=2)
    assert b["input_ids"].shape == (4, 4)  # longest p + 1 = 3, rounded to 2
    assert b["token_mask"].tolist() == [[0, 0, 1, 0], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 0]]
    assert b["returns"].tolist() == [[0, 0, 1, 0], [0, 0, 0, 0], [0, 0, 1, 0], [0, 0, 0, 0]]
    assert b["rewards"].tolist() == [1.0, 0.0, 1.0, 0.0] and b["input_lengths"].tolist() == [3, 2, 3, 2]
    assert b["values"][0, 2] == 2.0 and b["values"][1, 1] == 6.0
