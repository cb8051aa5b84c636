"""Builds attention inputs in any format from per-sequence tensors, and reads outputs back."""
import torch


def make_sequences(lens, heads, dim, dtype, gen):
    return [torch.randn(n, heads, dim, generator=gen).to(dtype) for n in lens]


def to_format(seqs, fmt, pad_len=None, gen=None):
    """Per-sequence [n, h, d] tensors -> one tensor in fmt (garbage in padding slots)."""
    if fmt == "thd":
        return torch.cat(seqs, 0)
    pad_len = max(s.shape[0] for s in seqs) if pad_len is None else pad_len
    h, d = seqs[0].shape[1:]
    out = torch.randn(len(seqs), pad_len, h, d, generator=gen).to(seqs[0].dtype) * 100
    for b, s in enumerate(seqs):
        out[b, : s.shape[0]] = s
    return out if fmt == "bshd" else out.transpose(0, 1).contiguous()


def cu_seqlens(lens):
    return torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)


def padding_mask(lens, pad_len):
    return (torch.arange(pad_len).view(1, -1) >= torch.tensor(lens).view(-1, 1)).view(
        len(lens), 1, 1, pad_len)


def output_rows(out, fmt, lens, heads):
    """Output in fmt (heads merged) -> per-sequence [n, h, dv] and the padding rows."""
    if fmt == "thd":
        cu = cu_seqlens(lens).tolist()
        seqs = [out[cu[b]: cu[b + 1]] for b in range(len(lens))]
        pad = out[cu[-1]:]
    else:
        bsx = out if fmt == "bshd" else out.transpose(0, 1)
        seqs = [bsx[b, :n] for b, n in enumerate(lens)]
        pad = torch.cat([bsx[b, n:] for b, n in enumerate(lens)], 0)
    return [s.reshape(s.shape[0], heads, -1) for s in seqs], pad
