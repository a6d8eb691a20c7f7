"""The π_old entropy pass holds one bounded chunk of ``[chunk, V/TP]`` float32 temporaries, also
when ``logprob_chunk_size`` is null (issue 26, item 7).

Every tensor an aten op creates during the pass is recorded by a ``TorchDispatchMode`` (its
storage, its size, a weak reference that says when it is freed); the peak of the bytes alive at
once, over the storages the pass itself allocated, must stay within one chunk of
``[positions, V]`` float32 (plus the per-position vectors). Before the fix a null chunk size
made the forward pass hold a float32 copy of all bf16 logits and their exponentials at once:
two full ``[N, V]`` float32 blocks. Results are checked against an unchunked float64
computation, so the chunking cannot change what is computed.
"""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nemo_granular.distributed import vocab_parallel
from nemo_granular.distributed.vocab_parallel import vocab_parallel_entropy, vocab_parallel_logprob_and_entropy
from nemo_granular.nemo_rl.workers import dtensor_entropy, megatron_entropy


class LiveBytes(TorchDispatchMode):
    """Peak bytes of the storages created by aten ops inside the mode and alive at the same time."""

    def __init__(self, exclude: set[int]):
        super().__init__()
        self.exclude = set(exclude)
        self.live: dict[int, tuple[int, list]] = {}  # storage pointer -> (bytes, weak refs to its tensors)
        self.peak = 0
        self.largest = 0

    def _alive_bytes(self) -> int:
        total = 0
        for ptr in list(self.live):
            nbytes, refs = self.live[ptr]
            refs[:] = [r for r in refs if r() is not None]
            if refs:
                total += nbytes
            else:
                del self.live[ptr]
        return total

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                st = t.untyped_storage()
                ptr = st.data_ptr()
                if ptr in self.exclude or st.nbytes() == 0:
                    continue
                entry = self.live.setdefault(ptr, (st.nbytes(), []))
                entry[1].append(weakref.ref(t))
                self.largest = max(self.largest, st.nbytes())
        self.peak = max(self.peak, self._alive_bytes())
        return out


def _logits(n, V, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, V, generator=g, dtype=torch.float64) * 3
    z[3, : V // 2] = float("-inf")  # a masked row (0·log 0 = 0)
    return z.to(dtype)


def _entropy64(z):
    zd = z.double()
    logp = torch.log_softmax(zd, -1)
    return -(logp.exp() * torch.where(torch.isfinite(logp), logp, torch.zeros_like(logp))).sum(-1)


def _peak(fn, z):
    mode = LiveBytes({z.untyped_storage().data_ptr()})
    with torch.no_grad(), mode:
        out = fn()
    return out, mode


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("chunk_size", [None, 24])
def test_entropy_pass_holds_one_bounded_chunk(monkeypatch, dtype, chunk_size):
    n, V = 300, 512
    monkeypatch.setattr(vocab_parallel, "MAX_BLOCK_ELEMENTS", 32 * V)  # null chunk size: 16 positions
    rows = chunk_size or 16
    z = _logits(n, V, dtype)
    h, mode = _peak(lambda: vocab_parallel_entropy(z, None, chunk_size), z)
    block = rows * V * 4
    vectors = 8 * n * 8  # a few per-position float32/float64 vectors (lse, H, sums)
    assert mode.largest <= block, f"a temporary of {mode.largest} bytes, one chunk is {block}"
    assert mode.peak <= block + vectors, f"peak {mode.peak} bytes alive, one chunk is {block}"
    full = n * V * 4
    assert mode.peak < full / 4  # the unbounded pass held two full [n, V] float32 blocks
    tol = 2e-5 if dtype == torch.float32 else 3e-5  # float32 accumulation; bf16 logits are exact in float32
    torch.testing.assert_close(h.double(), _entropy64(z), rtol=0, atol=tol)


def test_fused_pass_bounded_and_float64_exact(monkeypatch):
    """float64 logits stay float64: chunked logprob + entropy equal the unchunked float64 values."""
    n, V = 97, 256
    monkeypatch.setattr(vocab_parallel, "MAX_BLOCK_ELEMENTS", 20 * V)
    z = _logits(n, V, torch.float64, seed=1)
    tgt = torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(2))
    tgt[3] = V - 1  # a finite logit in the masked row
    (lp, h), mode = _peak(lambda: vocab_parallel_logprob_and_entropy(z, tgt, None, 0, None), z)
    block, masked_row_fixup = 10 * V * 8, 4 * V * 8  # the masked row is recomputed on its own
    assert mode.largest <= block and mode.peak <= block + masked_row_fixup + 16 * n * 8  # + per-position vectors
    ref_lp = torch.log_softmax(z, -1).gather(-1, tgt[:, None]).squeeze(-1)
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-12)
    torch.testing.assert_close(h, _entropy64(z), rtol=0, atol=1e-12)


@pytest.mark.parametrize("worker", ["megatron", "dtensor"])
def test_worker_entropy_post_processing_bounded(monkeypatch, worker):
    """The workers' π_old entropy (``logprob_chunk_size: null``) through the same pass."""
    B, S, V = 3, 40, 384
    monkeypatch.setattr(vocab_parallel, "MAX_BLOCK_ELEMENTS", 16 * V)
    z = _logits(B * S, V, torch.bfloat16, seed=3).view(B, S, V)
    lengths = torch.tensor([40, 25, 31])
    fn = megatron_entropy if worker == "megatron" else dtensor_entropy
    out, mode = _peak(lambda: fn(z, input_lengths=lengths, seq_len=S, chunk_size=None), z)
    assert mode.largest <= 8 * V * 4 and mode.peak <= 8 * V * 4 + 16 * B * S * 8
    ref = _entropy64(z.view(-1, V)).view(B, S)
    for i, L in enumerate(lengths.tolist()):  # column t holds the entropy of position t − 1
        torch.testing.assert_close(out[i, 1:L].double(), ref[i, : L - 1], rtol=0, atol=3e-5)
        assert bool((out[i, L:] == 0).all()) and out[i, 0] == 0
