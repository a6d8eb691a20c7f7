"""Token groups (docs/algorithms/math.md §1) against the reference: token / sequence / segment / entropy_group ids."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference as R
from nemo_granular.core import groups as G


def _mask(rows):
    return torch.tensor(rows, dtype=torch.bool)


def test_token_and_sequence_ids():
    mask = _mask([[0, 1, 1, 0, 1], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]])
    assert G.token_group_ids(mask).tolist() == R.token_group_ids(mask)
    assert G.sequence_group_ids(mask).tolist() == R.sequence_group_ids(mask)
    assert G.num_groups(G.token_group_ids(mask)).tolist() == [3, 0, 5]
    assert G.num_groups(G.sequence_group_ids(mask)).tolist() == [1, 0, 1]


def test_segment_delimiter_closes_its_segment_and_tail_segment():
    D = 9
    table = torch.zeros(12, dtype=torch.bool)
    table[D] = True
    #            prompt(D ignored) | response: a D b b D c | pad
    toks = torch.tensor([[D, 1, 2, D, 4, 4, D, 5, 0]])
    mask = _mask([[0, 0, 1, 1, 1, 1, 1, 1, 0]])
    ids = G.segment_group_ids(toks, mask, table)
    assert ids.tolist() == [[-1, -1, 0, 0, 1, 1, 1, 2, -1]]
    assert ids.tolist() == R.segment_group_ids(toks, mask, [D])


def test_segment_edge_cases():
    D = 3
    table = R.delimiter_table(8, [D])
    toks = torch.tensor([[1, 2, 4, 5], [D, D, D, D], [1, 2, 4, D], [D, 1, 1, 1]])
    mask = _mask([[1, 1, 1, 1], [0, 1, 1, 1], [1, 1, 1, 1], [0, 1, 1, 1]])
    ids = G.segment_group_ids(toks, mask, table)
    assert ids.tolist() == [
        [0, 0, 0, 0],  # no delimiter: one segment (= sequence)
        [-1, 0, 1, 2],  # every token a delimiter: one-token segments
        [0, 0, 0, 0],  # final delimiter closes the only segment; no empty tail
        [-1, 0, 0, 0],  # delimiter in the prompt is ignored
    ]
    assert ids.tolist() == R.segment_group_ids(toks, mask, [D])


def test_entropy_groups_top_fraction_and_ties():
    H = torch.tensor([[0.5, 2.0, 2.0, 0.1, 2.0, 0.3, 0.0]])
    mask = _mask([[0, 1, 1, 1, 1, 1, 1]])
    # n = 6, k = ceil(0.2·6) = 2: the two highest, ties by position (cols 1, 2 beat col 4)
    ids = G.entropy_group_ids(H, mask, 0.2)
    assert ids.tolist() == [[-1, 0, 0, 1, 1, 1, 1]]
    assert ids.tolist() == R.entropy_group_ids(H, mask, [0.2])


def test_entropy_groups_exact_ceil():
    """ceil(0.3·10) = 3 (not 4 from the float product 3.0000000000000004)."""
    H = torch.arange(10, 0, -1).float()[None]
    mask = torch.ones(1, 10, dtype=torch.bool)
    ids = G.entropy_group_ids(H, mask, 0.3)
    assert (ids == 0).sum() == 3
    assert ids.tolist() == R.entropy_group_ids(H, mask, [0.3])


def test_entropy_groups_cut_points_and_empty_groups_dropped():
    H = torch.tensor([[3.0, 1.0, 2.0, 0.5], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    mask = _mask([[1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0]])
    cuts = [0.25, 0.5, 0.75]
    ids = G.entropy_group_ids(H, mask, cuts)
    # row 0: ranks 0..3 → groups 0,1,2,3 by entropy; row 1: one token, all cuts ≥ 1 → one group 0
    assert ids.tolist() == [[0, 2, 1, 3], [0, -1, -1, -1], [-1, -1, -1, -1]]
    assert ids.tolist() == R.entropy_group_ids(H, mask, cuts)
    # two tokens with cuts 0.25/0.5/0.75: ranks 0,1 → k = 1,1,2 → groups {0}, {2}: compacted to 0, 1
    H2, m2 = torch.tensor([[1.0, 2.0]]), torch.ones(1, 2, dtype=torch.bool)
    assert G.entropy_group_ids(H2, m2, cuts).tolist() == [[1, 0]] == R.entropy_group_ids(H2, m2, cuts)


@pytest.mark.parametrize("layout", ["right_padded", "left_padded"])
@pytest.mark.parametrize("values", ["continuous", "ties"])
@pytest.mark.parametrize("cuts", [0.2, [0.1, 0.5, 0.9], [0.5, 0.5000001]])
def test_entropy_groups_on_long_rows_match_reference(values, cuts, layout):
    """Rows of 300 tokens (the ranks come from a partial sort, the reference sorts each row in Python):
    rows of every length from empty to full, entropies continuous or from five values (ties across
    every cut), cut points that leave a group empty. Right padding leaves each short row's +inf pads
    room in its own masked end (``_kth_largest``'s in-place path); left padding does not (appended
    columns)."""
    g = torch.Generator().manual_seed(7)
    B, T = 9, 300
    lengths = torch.tensor([0, 1, 2, 5, 37, 150, 299, 300, 211])
    mask = torch.arange(T)[None] < lengths[:, None]
    mask[8] &= torch.rand(T, generator=g) < 0.6  # holes inside a row
    if layout == "left_padded":
        mask = mask.flip(-1)
    H = torch.rand(B, T, generator=g) * 3
    if values == "ties":
        H = (H * 4).floor() * 0.25
    ids = G.entropy_group_ids(H, mask, cuts)
    assert ids.tolist() == R.entropy_group_ids(H, mask, [cuts] if isinstance(cuts, float) else cuts)
    assert ids.dtype == torch.long
    assert torch.equal(G.entropy_group_ids(H, mask, cuts, dtype=torch.float64), ids.double())


def test_compact_group_ids():
    ids = torch.tensor([[2, -1, 2, 5, 0], [-1, -1, -1, -1, -1]])
    assert G.compact_group_ids(ids).tolist() == [[1, -1, 1, 2, 0], [-1] * 5]


def test_group_ids_for_dispatch_and_errors():
    mask = _mask([[1, 1, 1]])
    assert G.group_ids_for("sequence", mask).tolist() == [[0, 0, 0]]
    with pytest.raises(ValueError, match="segment"):
        G.group_ids_for("segment", mask)
    with pytest.raises(ValueError, match="entropy"):
        G.group_ids_for("entropy_group", mask)
    with pytest.raises(ValueError, match="granularity"):
        G.group_ids_for("paragraph", mask)
    # non-finite entropy is dropped from the mask by the dispatcher
    H = torch.tensor([[1.0, float("nan"), 0.5]])
    assert G.group_ids_for("entropy_group", mask, entropy=H, entropy_cut_points=0.5).tolist() == [[0, -1, 1]]


def test_build_delimiter_table_from_a_real_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"a": 0, "b": 1, "\n\n": 2, "x\n\ny": 3, "\n": 4, ".": 5, "[UNK]": 6}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    table = G.build_delimiter_table(hf, ["\n\n"], vocab_size=10)
    assert table.shape == (10,)
    assert table.nonzero().flatten().tolist() == [2, 3]
    table = G.build_delimiter_table(hf, ["\n", "."])
    assert table.nonzero().flatten().tolist() == [2, 3, 4, 5]
    for bad in ([], [""]):
        with pytest.raises(ValueError, match="segment_delimiters"):
            G.build_delimiter_table(hf, bad)


@settings(max_examples=30, deadline=None)
@given(
    B=st.integers(1, 4),
    T=st.integers(0, 16),
    seed=st.integers(0, 10_000),
    cuts=st.sampled_from([0.2, 0.5, 0.99, [0.3, 0.7], [0.1, 0.2, 0.9]]),
    n_delims=st.integers(0, 3),
)
def test_property_group_ids_match_reference(B, T, seed, cuts, n_delims):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=g) < 0.7
    toks = torch.randint(0, 10, (B, T), generator=g)
    delims = list(range(n_delims))
    table = R.delimiter_table(10, delims)
    H = torch.randint(0, 5, (B, T), generator=g).float() * 0.25  # many ties
    assert G.token_group_ids(mask).tolist() == R.token_group_ids(mask)
    assert G.sequence_group_ids(mask).tolist() == R.sequence_group_ids(mask)
    assert G.segment_group_ids(toks, mask, table).tolist() == R.segment_group_ids(toks, mask, delims)
    ids = G.entropy_group_ids(H, mask, cuts)
    assert ids.tolist() == R.entropy_group_ids(H, mask, [cuts] if isinstance(cuts, float) else cuts)
    # contract: ids contiguous 0..G_i-1 (no empty group), -1 exactly outside the mask
    for row, m in zip(ids.tolist(), mask.tolist()):
        present = sorted({x for x in row if x >= 0})
        assert present == list(range(len(present)))
        assert all((x >= 0) == bool(mm) for x, mm in zip(row, m))
