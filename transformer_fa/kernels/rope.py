"""Fused rotary position embedding (TE's ``apply_rotary_pos_emb(..., fused=True)``) in Triton.

One kernel serves forward and backward: RoPE rotates each channel pair by an angle, and its
gradient is the rotation by the opposite angle. A program takes one token (one (s, b)) and a
block of heads; the angles are read from the float32 frequency table at the token's position
and their cos/sin computed in float32. Channels past the table's width pass through.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _rope_kernel(T, OUT, FREQS, POS, n_b, n_heads, head_dim, rot_dim,
                 stride_ts, stride_tb, stride_th, stride_os, stride_ob, stride_oh,
                 stride_ps, stride_pb, stride_f,
                 HAS_POS: tl.constexpr, INTERLEAVED: tl.constexpr, BACKWARD: tl.constexpr,
                 BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    s = token // n_b
    b = token % n_b
    if HAS_POS:
        pos = tl.load(POS + s * stride_ps + b * stride_pb).to(tl.int64)
    else:
        pos = s
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    rotated = d < rot_dim
    # each channel's partner in its pair and the sign RoPE gives the partner: [-x2, x1]
    if INTERLEAVED:
        partner = d ^ 1
        first = (d % 2) == 0
    else:
        half = rot_dim // 2
        first = d < half
        partner = tl.where(first, d + half, d - half)
    sign = tl.where(first, -1.0, 1.0)
    angle = tl.load(FREQS + pos * stride_f + d, mask=rotated, other=0.0)
    cos = tl.cos(angle)
    if BACKWARD:
        # dx[d] = dy[d] cos(f[d]) - sign[d] dy[p(d)] sin(f[p(d)])
        partner_angle = tl.load(FREQS + pos * stride_f + partner, mask=rotated, other=0.0)
        sin = -sign * tl.sin(partner_angle)
    else:
        sin = sign * tl.sin(angle)

    mask = (heads < n_heads)[:, None] & (d < head_dim)[None, :]
    row = T + s * stride_ts + b * stride_tb + heads[:, None] * stride_th
    x = tl.load(row + d[None, :], mask=mask, other=0.0).to(tl.float32)
    x_partner = tl.load(row + partner[None, :], mask=mask & rotated[None, :],
                        other=0.0).to(tl.float32)
    y = tl.where(rotated[None, :], x * cos[None, :] + x_partner * sin[None, :], x)
    out = OUT + s * stride_os + b * stride_ob + heads[:, None] * stride_oh + d[None, :]
    tl.store(out, y.to(OUT.dtype.element_ty), mask=mask)


def _as_sbhd(x: torch.Tensor, tensor_format: str) -> torch.Tensor:
    """A [s, b, h, d] view of x (thd: [t, 1, h, d])."""
    if tensor_format == "thd":
        return x.unsqueeze(1)
    return x.transpose(0, 1) if tensor_format == "bshd" else x


def _rope(t, table, positions, tensor_format, interleaved, backward):
    if t.stride(-1) != 1:
        t = t.contiguous()
    out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    t4, out4 = _as_sbhd(t, tensor_format), _as_sbhd(out, tensor_format)
    n_s, n_b, n_heads, head_dim = t4.shape
    if positions is None:
        pos, pos_strides = table, (0, 0)  # the position is s; the pointer is not read
    else:
        # thd: [t] -> [t, 1]; else [b | 1, s] -> [s, b]
        pos = positions.unsqueeze(1) if tensor_format == "thd" else positions.t()
        pos = pos.expand(n_s, n_b)
        pos_strides = pos.stride()
    block_d = triton.next_power_of_2(head_dim)
    block_h = min(triton.next_power_of_2(n_heads), max(1, 4096 // block_d))
    grid = (n_s * n_b, triton.cdiv(n_heads, block_h))
    _rope_kernel[grid](
        t4, out4, table, pos, n_b, n_heads, head_dim, table.shape[1],
        t4.stride(0), t4.stride(1), t4.stride(2), out4.stride(0), out4.stride(1),
        out4.stride(2), pos_strides[0], pos_strides[1], table.stride(0),
        HAS_POS=positions is not None, INTERLEAVED=interleaved, BACKWARD=backward,
        BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4)
    return out


class FusedRoPE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, table, positions, tensor_format, interleaved):
        ctx.save_for_backward(table, positions)
        ctx.tensor_format, ctx.interleaved = tensor_format, interleaved
        return _rope(t, table, positions, tensor_format, interleaved, backward=False)

    @staticmethod
    def backward(ctx, grad):
        table, positions = ctx.saved_tensors
        dt = _rope(grad, table, positions, ctx.tensor_format, ctx.interleaved, backward=True)
        return dt, None, None, None, None


def fused_rope(t, table, positions, tensor_format, interleaved):
    """RoPE of t ([s, b, h, d], [b, s, h, d] or [t, h, d]) by the float32 ``table``
    ``[max_len, rot_dim]`` (contiguous). positions: None (position = index along s), int64
    ``[b | 1, s]`` for sbhd/bshd or ``[t]`` for thd."""
    return FusedRoPE.apply(t, table.contiguous(), positions, tensor_format, interleaved)
