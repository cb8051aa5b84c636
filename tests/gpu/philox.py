"""The FlashAttention kernels' dropout mask in torch, for the tests' reference.

The kernels' own statement of it is in csrc/flash/flash.h; the two must stay the same.

For batch (sequence) index b, query head h, per-sequence query position i and key position j:
  words = Philox4x32-10(counter, key) (Random123), with
    key     = (seed & 0xffffffff, seed >> 32)
    counter = (j >> 3,
               ((i >> 4) << 5) | ((i & 7) << 2) | ((j >> 1) & 3),
               b * H + h,                       H = number of query heads
               offset & 0xffffffff)
  w = ((i >> 3) & 1) * 2 + (j & 1)
  kept iff words[w] < threshold, threshold = min(floor((1 - p) * 2**32), 2**32 - 1) (in double)
(seed, offset) is the int64 rng_state [2] the forward drew and saved. Kept elements are scaled
by 1 / (1 - p): O = (P * Z) V with Z = keep / (1 - p) and P the softmax probabilities; the
LSE is that of the softmax before dropout.
Four elements share one Philox call: those that differ only in bit 3 of i and bit 0 of j.

All math is int64 on 32-bit values, vectorized over whole [b, h, sq, sk] grids.
"""
import math

import torch

M0, M1 = 0xD2511F53, 0xCD9E8D57  # multipliers
W0, W1 = 0x9E3779B9, 0xBB67AE85  # key bumps (Weyl sequence)
MASK32 = 0xFFFFFFFF


def _mulhilo(m: int, x: torch.Tensor):
    """(hi, lo) 32-bit halves of m * x for 32-bit m and x, without int64 overflow (the full
    product needs 64 unsigned bits): split x in 16-bit halves."""
    a = m * (x & 0xFFFF)            # < 2**48
    b = m * (x >> 16)               # < 2**48
    t = a + ((b & 0xFFFF) << 16)    # < 2**49
    return (b >> 16) + (t >> 32), t & MASK32


def philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 on int64 tensors (or ints) holding 32-bit values; they broadcast.
    Returns the four output words (int64 tensors)."""
    c0, c1, c2, c3 = (torch.as_tensor(c, dtype=torch.int64) for c in (c0, c1, c2, c3))
    k0, k1 = int(k0) & MASK32, int(k1) & MASK32
    for _ in range(10):
        hi0, lo0 = _mulhilo(M0, c0)
        hi1, lo1 = _mulhilo(M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + W0) & MASK32, (k1 + W1) & MASK32
    return c0, c1, c2, c3


def threshold(p: float) -> int:
    return min(math.floor((1.0 - p) * 4294967296.0), MASK32)


def keep_mask(rng_state, p: float, batch: int, heads: int, sq: int, sk: int,
              device=None) -> torch.Tensor:
    """bool [batch, heads, sq, sk]: True where the kernel keeps element (b, h, i, j).
    rng_state: (seed, offset), a tensor or a pair of ints."""
    seed, offset = (int(x) for x in (rng_state.tolist() if torch.is_tensor(rng_state)
                                     else rng_state))
    if device is None:
        device = rng_state.device if torch.is_tensor(rng_state) else "cpu"

    def ar(n, dim):
        shape = [1, 1, 1, 1]
        shape[dim] = n
        return torch.arange(n, dtype=torch.int64, device=device).view(shape)

    b, h, i, j = ar(batch, 0), ar(heads, 1), ar(sq, 2), ar(sk, 3)
    words = philox4x32_10(j >> 3, ((i >> 4) << 5) | ((i & 7) << 2) | ((j >> 1) & 3),
                          b * heads + h, torch.tensor(offset & MASK32, device=device),
                          seed & MASK32, seed >> 32)
    w = ((i >> 3) & 1) * 2 + (j & 1)
    word = torch.where(w == 0, words[0], torch.where(
        w == 1, words[1], torch.where(w == 2, words[2], words[3])))
    return word < threshold(p)


def dropout_scale(rng_state, p: float, batch: int, heads: int, sq: int, sk: int,
                  device=None) -> torch.Tensor:
    """float32 Z [batch, heads, sq, sk]: 1 / (1 - p) where kept, else 0."""
    keep = keep_mask(rng_state, p, batch, heads, sq, sk, device)
    return keep.float() * (1.0 / (1.0 - p))
