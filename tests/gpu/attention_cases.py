"""Shared by the GPU backend tests: case descriptions, inputs built as real views of one
buffer where a layout packs them, and the float32 reference with the FlashAttention error rule.
"""
import dataclasses
import logging

import torch

DEV = "cuda"


@dataclasses.dataclass
class Case:
    fmt: str = "bshd"                 # q format
    kv_fmt: str = None                # kv format (default: fmt)
    layout: str = "separate"          # separate | 3 | h3 | 2 | h2 | gqa_split
    b: int = 2
    sq: int = 128
    skv: int = None
    hq: int = 4
    hkv: int = None
    dqk: int = 64
    dv: int = None
    dtype: torch.dtype = torch.bfloat16
    mask: str = "causal"              # thd cases become their padding variant, as in TE
    window: tuple = None
    lens_q: list = None               # padding / thd: actual lengths
    lens_kv: list = None
    bias: str = None                  # post_scale_bias shape code: 1hss | b1ss | bhss | 11ss
    bias_grad: bool = False
    alibi: str = None                 # "h" or "bh" slopes
    scale: float = None
    k_growth: str = None              # "ramp" / "jump": K scaled up toward key 0 (k_gain)
    must: bool = True                 # the backend claims this case
    seed: int = 0

    def __post_init__(self):
        self.kv_fmt = self.kv_fmt or self.fmt
        self.skv = self.skv or self.sq
        self.hkv = self.hkv or self.hq
        self.dv = self.dv or self.dqk
        if self.window is None:
            self.window = (-1, 0) if "causal" in self.mask else (-1, -1)
        thd = "thd" in (self.fmt, self.kv_fmt)
        if self.lens_q is not None:
            self.b = len(self.lens_q)
        if (thd or "padding" in self.mask) and self.lens_q is None:
            gen = torch.Generator().manual_seed(self.b * 7 + self.sq + self.seed)
            self.lens_q = torch.randint(1, self.sq + 1, (self.b,), generator=gen).tolist()
            self.lens_q[0] = self.sq
            if self.lens_kv is None and self.skv == self.sq:
                self.lens_kv = list(self.lens_q)
            elif self.lens_kv is None:
                self.lens_kv = torch.randint(1, self.skv + 1, (self.b,), generator=gen).tolist()
                self.lens_kv[-1] = self.skv
        if self.lens_kv is None and self.lens_q is not None:
            self.lens_kv = list(self.lens_q)
        if thd:
            # thd tensors are exactly as long as their sequences; the max is the longest one
            if self.fmt == "thd":
                self.sq = max(self.lens_q)
            if self.kv_fmt == "thd":
                self.skv = max(self.lens_kv)
            if "padding" not in self.mask:
                self.mask = "padding" if self.mask == "no_mask" else "padding_" + self.mask

    @property
    def padded(self):
        return self.lens_q is not None

    @property
    def qkv_format(self):
        return self.fmt if self.fmt == self.kv_fmt else f"{self.fmt}_2{self.kv_fmt}"

    @property
    def layout_name(self):
        """The TE layout string these inputs are in."""
        p = {"sbhd": "sb", "bshd": "bs", "thd": "t"}
        if self.fmt != self.kv_fmt or self.layout in ("separate", "gqa_split"):
            return f"{self.fmt}_{self.kv_fmt}_{self.kv_fmt}"
        f, x = self.fmt, p[self.fmt]
        return {"3": f"{x}3hd", "h3": f"{x}h3d", "2": f"{f}_{x}2hd",
                "h2": f"{f}_{x}h2d"}[self.layout]

    def __str__(self):
        lens = f" lens{self.lens_q}/{self.lens_kv}" if self.padded else ""
        return (f"{self.qkv_format}/{self.layout} b{self.b} s{self.sq}x{self.skv} h{self.hq}/"
                f"{self.hkv} d{self.dqk}/{self.dv} {str(self.dtype)[6:]} {self.mask} "
                f"w{self.window} bias={self.bias}{'+grad' if self.bias_grad else ''} "
                f"alibi={self.alibi}{lens}{' k=' + self.k_growth if self.k_growth else ''}")


def k_gain(growth, skv):
    """[skv] factors for K's rows that make the scores grow toward key 0, which the flash
    kernels visit last: "ramp" from 1 (last key) to 8 (key 0), "jump" 16 on keys 0-63 only."""
    j = torch.arange(skv, device=DEV, dtype=torch.float32)
    if growth == "ramp":
        return 1 + 7 * (1 - j / skv)
    return torch.where(j < 64, 16.0, 1.0)


def cu_seqlens(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32,
                        device=DEV)


def to_format(xp, fmt, lens):
    """padded bshd [b, s, h, d] -> fmt (thd: packed by lens)."""
    if fmt == "bshd":
        return xp
    if fmt == "sbhd":
        return xp.transpose(0, 1)
    return torch.cat([xp[i, :n] for i, n in enumerate(lens)], 0)


def to_padded(x, fmt, lens, s):
    """fmt -> padded bshd [b, s, h, d] (zeros in padding slots for thd)."""
    if fmt == "bshd":
        return x
    if fmt == "sbhd":
        return x.transpose(0, 1)
    out = x.new_zeros((len(lens), s) + tuple(x.shape[1:]))
    start = 0
    for i, n in enumerate(lens):
        out[i, :n] = x[start:start + n]
        start += n
    return out


def build_inputs(c: Case, seed=None, requires_grad=True):
    """Padded data (bshd), the q, k, v tensors the backend gets (views of one buffer where
    the layout packs them; padding slots hold large garbage to ignore), and the leaves."""
    gen = torch.Generator(device=DEV).manual_seed(c.seed if seed is None else seed)
    qp = torch.randn(c.b, c.sq, c.hq, c.dqk, generator=gen, device=DEV).to(c.dtype)
    kp = torch.randn(c.b, c.skv, c.hkv, c.dqk, generator=gen, device=DEV)
    if c.k_growth:
        kp = kp * k_gain(c.k_growth, c.skv).view(1, -1, 1, 1)
    kp = kp.to(c.dtype)
    vp = torch.randn(c.b, c.skv, c.hkv, c.dv, generator=gen, device=DEV).to(c.dtype)
    if c.padded:
        for i in range(c.b):
            for x, n in ((qp, c.lens_q[i]), (kp, c.lens_kv[i]), (vp, c.lens_kv[i])):
                x[i, n:] = (100 * torch.randn(x[i, n:].shape, generator=gen,
                                              device=DEV)).to(c.dtype)
    qf = to_format(qp, c.fmt, c.lens_q)
    kf = to_format(kp, c.kv_fmt, c.lens_kv)
    vf = to_format(vp, c.kv_fmt, c.lens_kv)

    leaves = []

    def leaf(t):
        t = t.detach().clone().requires_grad_(requires_grad)
        leaves.append(t)
        return t

    if c.layout == "separate" or c.fmt != c.kv_fmt:
        q, k, v = leaf(qf.contiguous()), leaf(kf.contiguous()), leaf(vf.contiguous())
    elif c.layout == "gqa_split":  # [.., hq + 2 hkv, d] split along heads: strided views
        assert c.dqk == c.dv
        buf = leaf(torch.cat([qf, kf, vf], dim=-2).contiguous())
        q, k, v = buf.split([c.hq, c.hkv, c.hkv], dim=-2)
    else:
        n = 3 if c.layout in ("3", "h3") else 2
        dim = -2 if c.layout in ("h3", "h2") else -3
        parts = [qf, kf, vf] if n == 3 else [kf, vf]
        buf = leaf(torch.stack(parts, dim=dim).contiguous())
        views = buf.unbind(dim)
        q, k, v = (views if n == 3 else (leaf(qf.contiguous()),) + views)
    return (qp, kp, vp), (q, k, v), leaves


def _lengths(c: Case):
    lq = torch.tensor(c.lens_q if c.padded else [c.sq] * c.b, device=DEV).view(-1, 1, 1, 1)
    lk = torch.tensor(c.lens_kv if c.padded else [c.skv] * c.b, device=DEV).view(-1, 1, 1, 1)
    i = torch.arange(c.sq, device=DEV).view(1, 1, -1, 1)
    j = torch.arange(c.skv, device=DEV).view(1, 1, 1, -1)
    return lq, lk, i, j


def keep_mask(c: Case, mask_type=None):
    """bool [b, 1, sq, skv], True = attend (TE semantics, per-sequence lengths)."""
    mask_type = c.mask if mask_type is None else mask_type
    lq, lk, i, j = _lengths(c)
    off = 0 if mask_type in ("causal", "padding_causal") else lk - lq
    left, right = c.window
    if "causal" in mask_type:
        right = 0
    keep = (i < lq) & (j < lk)
    if left >= 0:
        keep = keep & (j >= i + off - left)
    if right >= 0:
        keep = keep & (j <= i + off + right)
    return keep


def alibi_bias(c: Case, slopes, mask_type):
    lq, lk, i, j = _lengths(c)
    off = 0 if mask_type in ("causal", "padding_causal") else lk - lq
    s = slopes.view(1, -1, 1, 1) if slopes.dim() == 1 else slopes.view(c.b, -1, 1, 1)
    return -s * (i + off - j).abs().float()


def reference(qp, kp, vp, keep, scale, bias=None, upcast=True, dropout=None, float_bias=False):
    """(out [b, sq, hq, dv], lse [b, hq, sq] float32). upcast: float32 math; else the same
    math in the input dtype (scores and P rounded to it). dropout: Z [b, hq, sq, skv]
    (keep / (1 - p)) multiplied into P after the softmax; the LSE is of the softmax before.
    float_bias: add the bias to float32 scores (a kernel that makes the bias itself, ALiBi)."""
    dtype = qp.dtype
    if upcast:
        qp, kp, vp = qp.float(), kp.float(), vp.float()
        bias = bias.float() if bias is not None else None
    g = qp.shape[2] // kp.shape[2]
    kp = kp.repeat_interleave(g, dim=2)
    vp = vp.repeat_interleave(g, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", qp, kp) * scale
    if bias is not None:
        s = s.float() + bias.float() if float_bias else s + bias.to(s.dtype)
    s = s.float().masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    if dropout is not None:
        p = p * dropout
    p = p if upcast else p.to(dtype)
    return torch.einsum("bhqk,bkhd->bqhd", p, vp), lse


def reference_grads(qp, kp, vp, dout_p, keep, scale, upcast=True, **kw):
    """reference() with its gradients for dout_p: (out, lse, (dq, dk, dv)), padded bshd.
    upcast: float32 leaves (so the gradients are not rounded to the input dtype)."""
    leaves = [(x.detach().float() if upcast else x.detach().clone()).requires_grad_()
              for x in (qp, kp, vp)]
    out, lse = reference(*leaves, keep, scale, upcast=upcast, **kw)
    grads = torch.autograd.grad(out, leaves, dout_p.to(out.dtype))
    return out.detach(), lse.detach(), grads


def check(name, ours, ref32, refdt, atol):
    """The FlashAttention rule: max error <= 2x that of the same math in the input dtype
    plus atol (relative to the reference's magnitude); NaN (an unwritten element) fails."""
    ours, ref32, refdt = ours.float(), ref32.float(), refdt.float()
    assert not ours.isnan().any(), f"{name}: NaN in the output (an unwritten element?)"
    err = (ours - ref32).abs().max().item() if ours.numel() else 0.0
    base = (refdt - ref32).abs().max().item() if ours.numel() else 0.0
    tol = 2 * base + atol * max(1.0, ref32.abs().max().item() if ours.numel() else 0.0)
    assert err <= tol, f"{name}: max error {err:.4g} > {tol:.4g} (2 x {base:.4g} + atol)"


def valid_rows(xp, lens):
    return xp if lens is None else torch.cat([xp[i, :n] for i, n in enumerate(lens)], 0)


def pad_rows(xp, lens):
    if lens is None:
        return xp[:, :0]
    return torch.cat([xp[i, n:] for i, n in enumerate(lens)], 0)


def out_to_padded(out, c: Case):
    """An output with heads merged -> padded bshd [b, sq, hq, dv]."""
    if c.fmt == "thd":
        return to_padded(out.view(out.shape[0], c.hq, c.dv), "thd", c.lens_q, c.sq)
    if c.fmt == "sbhd":
        return out.view(c.sq, c.b, c.hq, c.dv).transpose(0, 1)
    return out.view(c.b, c.sq, c.hq, c.dv)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


class capture_log:
    """The DotProductAttention logger's lines (it may not propagate to the root logger)."""

    def __enter__(self):
        self.logger = logging.getLogger("DotProductAttention")
        self.level = self.logger.level
        self.handler = _Records()
        self.logger.addHandler(self.handler)
        self.logger.setLevel(logging.DEBUG)
        return self.handler.lines

    def __exit__(self, *exc):
        self.logger.removeHandler(self.handler)
        self.logger.setLevel(self.level)
