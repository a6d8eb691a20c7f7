"""Single-process checks of the layout helpers against their definitions (no process group)."""

import pytest
import torch

from nemo_granular.distributed import pack_sequences, unpack_sequences, zigzag_gather_index, zigzag_shard


def _zigzag_by_definition(seq, rank, cp):
    """Megatron: cut in 2·CP equal chunks; rank r holds chunks r and 2·CP−1−r."""
    chunks = seq.chunk(2 * cp)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]])


@pytest.mark.parametrize("cp", [2, 4])
def test_packed_zigzag_matches_definition_incl_trailing_padding(cp):
    lengths = [2 * cp, 6 * cp, 4 * cp]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    T = int(cu[-1]) + 2 * cp  # packed row padded after the last sequence
    x = torch.arange(T)[None] * 10
    for r in range(cp):
        slots = [x[0, int(a) : int(b)] for a, b in zip(cu[:-1], cu[1:])] + [x[0, int(cu[-1]) : T]]
        expect = torch.cat([_zigzag_by_definition(s, r, cp) for s in slots])
        assert torch.equal(zigzag_shard(x, r, cp, dim=1, cu_seqlens_padded=cu)[0], expect)
    gathered = torch.cat([zigzag_shard(x, r, cp, dim=1, cu_seqlens_padded=cu) for r in range(cp)], 1)[0]
    assert torch.equal(gathered[zigzag_gather_index(T // cp, cp, cu)], x[0])
    with pytest.raises(ValueError, match="multiple of 2·CP"):
        zigzag_gather_index(T // cp, cp, torch.tensor([0, 3, T]))


def test_pack_unpack_roundtrip_and_shift():
    x = torch.arange(1, 25, dtype=torch.float).view(3, 8)
    lengths = torch.tensor([8, 2, 5])
    packed, cu, cu_pad = pack_sequences(x, lengths, pad_multiple=4)
    assert cu.tolist() == [0, 8, 10, 15] and cu_pad.tolist() == [0, 8, 12, 20]
    keep = torch.arange(8)[None] < lengths[:, None]
    assert torch.equal(unpack_sequences(packed, cu_pad, lengths, 8), x * keep)
    shifted = unpack_sequences(packed, cu_pad, lengths, 8, shift=1)
    assert shifted[:, 0].abs().sum() == 0
    assert torch.equal(shifted[:, 1:] * keep[:, 1:], x[:, :-1] * keep[:, 1:])
    assert shifted[1, 2:].abs().sum() == 0
