"""A small varlen case for compute-sanitizer (racecheck / memcheck): thd, ragged lengths
that are not multiples of the tiles, GQA, masks of both alignments and a sliding window, every
built kernel head dim and one that is padded up, dropout and ALiBi on some calls; then a
bshd batch with sq != sk, neither a multiple of the tiles (the backward's dsum kernel zeroes
dq_accum there; thd has it zeroed by the binding).
With --backward, the backward runs after each forward (and once deterministic).
See tests/gpu/README.md for the commands.

    python tools/flash_sanitize_case.py [--backward] [--dims 64,128]
    python tools/flash_sanitize_case.py --sm90
    python tools/flash_sanitize_case.py --sm90-backward
    python tools/flash_sanitize_case.py --decode
    python tools/flash_sanitize_case.py --fp8-cast
"""
import argparse
import math
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from transformer_fa.attention.backends import flash  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--backward", action="store_true", help="run the backward too")
parser.add_argument("--dims", default="40,64,128,192,256", help="head dims, comma separated")
parser.add_argument("--sm90", action="store_true",
                    help="only the sm90 family's forward (bshd, its persistent grid looping "
                         "over more tiles than SMs, ragged tails, sq != sk), causal and not; "
                         "then varlen thd (ragged, empty sequences) at d64, d256 and d40 with "
                         "windows; head dims between the kernels' too; all of it with the "
                         "default tile hand-out, then with the dynamic scheduler")
parser.add_argument("--sm90-backward", action="store_true",
                    help="only the sm90 family's backward: thd with ragged lengths (a tile "
                         "reaching into the next sequence, a one-token sequence) and bshd with "
                         "sq != sk, no mask, causal of both alignments, sliding windows (left, "
                         "right, both), d40 (the d64 kernel, columns past d), d64, d128, d192 "
                         "(the d256 kernel, columns past d) and d256, MHA and GQA (4 "
                         "query heads on 2 KV heads: dK / dV reductions); each also "
                         "deterministic (dQ additions, and GQA's dK / dV, in turn)")
parser.add_argument("--decode", action="store_true",
                    help="only the split-KV decode kernel: thd and padded bshd queries against "
                         "contiguous and paged K/V (shuffled pages of 16 and 64), ragged cached "
                         "lengths, GQA, causal and windowed, 1, 3 and chosen splits")
parser.add_argument("--fp8-cast", action="store_true",
                    help="only the FP8 cast-transpose and amax kernels (csrc/fp8/): bf16 and "
                         "fp16, both FP8 formats, plain / GELU / dgelu casts with and without "
                         "the row-major output and the column sums, delayed and current "
                         "scaling, amax passes, on shapes whose last tiles are ragged in both "
                         "directions and on a strided view")
args = parser.parse_args()

assert flash._extension() is not None, flash._ext_error
if args.sm90:
    # Each case twice: with the default tile hand-out (the persistent grid's static order where
    # it is persistent), then with the dynamic scheduler (TRANSFORMER_FA_SM90_SCHEDULER:
    # every tile on a persistent grid whose CTAs claim tiles from a counter).
    for scheduler in ("", "dynamic"):
        os.environ["TRANSFORMER_FA_SM90_SCHEDULER"] = scheduler
        # 3 x 8 heads x 8 query tiles = 192 tiles: a persistent CTA takes a second tile (Q's
        # buffer reused) on a 132-SM H100. GQA (8 query heads on 2 KV heads);
        # length 1000 (the key tail masked, the query tail not stored); then sq != sk with the
        # bottom-right diagonal; head dims 64, 128 and 256 (every tile stores O from registers;
        # a persistent CTA loads the next Q under the epilogue) and 96 and 200 (the d128 and d256 kernels with columns past d: zero-filled,
        # not stored); the short-row tiles and the others.
        for d, tiles in ((64, "0"), (64, "1"), (128, "0"), (128, "1"), (256, "0"), (256, "1"),
                         (96, ""), (200, "")):
            os.environ["TRANSFORMER_FA_SM90_SHORT_TILES"] = tiles
            for sq, sk, br in ((1000, 1000, False), (300, 700, True)):
                q = torch.randn(3, sq, 8, d, device="cuda", dtype=torch.bfloat16)
                k, v = (torch.randn(3, sk, 2, d, device="cuda", dtype=torch.bfloat16)
                        for _ in "kv")
                for right in (-1, 0):
                    call = flash.FlashCall("bshd", "bshd", sq, sk, 1 / math.sqrt(d), -1, right,
                                           br, 0.0, False, True, 90)
                    out, lse = flash._fwd_impl(q, k, v, None, None, None, None, call)
        os.environ.pop("TRANSFORMER_FA_SM90_SHORT_TILES")
        # Varlen thd, ragged: query tiles that start inside a sequence and read the next one's
        # rows (not stored), key tails whose V rows are zeroed, an empty sequence of each side,
        # a one-token one; no mask, causal both ways, windows (the empty-tile path). 7 sequences
        # x 48 heads: more tiles than SMs, so persistent CTAs take empty tiles after loaded ones.
        lens_q, lens_k = [1, 63, 65, 200, 0, 5, 129], [1, 63, 65, 200, 9, 0, 81]
        cu_q, cu_k = (torch.tensor([0] + torch.tensor(n).cumsum(0).tolist(), dtype=torch.int32,
                                   device="cuda") for n in (lens_q, lens_k))
        for d in (64, 256, 40):
            q = torch.randn(sum(lens_q) + 3, 48, d, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(sum(lens_k) + 3, 12, d, device="cuda", dtype=torch.bfloat16)
                    for _ in "kv")
            for left, right, br in ((-1, -1, False), (-1, 0, True), (48, 16, False),
                                    (64, 0, False)):
                call = flash.FlashCall("thd", "thd", max(lens_q), max(lens_k), 1 / math.sqrt(d),
                                       left, right, br, 0.0, False, True, 90)
                out, lse = flash._fwd_impl(q, k, v, cu_q, cu_k, None, None, call)
    os.environ.pop("TRANSFORMER_FA_SM90_SCHEDULER")
    torch.cuda.synchronize()
    print("sanitize case done (sm90)", out.float().abs().sum().item())
    sys.exit(0)
if args.sm90_backward:
    lens_q, lens_k = [37, 130, 1, 200], [50, 129, 9, 70]
    cu_q, cu_k = (torch.tensor([0] + torch.tensor(n).cumsum(0).tolist(), dtype=torch.int32,
                               device="cuda") for n in (lens_q, lens_k))
    for d in (int(x) for x in args.dims.split(",") if int(x) <= 256):
        for dtype, hk in ((torch.bfloat16, 4), (torch.float16, 4), (torch.bfloat16, 2)):
            thd = [torch.randn(sum(n), h, d, device="cuda", dtype=dtype)
                   for n, h in ((lens_q, 4), (lens_k, hk), (lens_k, hk))]
            bshd = [torch.randn(2, s, h, d, device="cuda", dtype=dtype)
                    for s, h in ((170, 4), (300, hk), (300, hk))]
            # sq = sk: deterministic mode's rotation (a multiple of the key blocks in query blocks)
            square = [torch.randn(2, 300, h, d, device="cuda", dtype=dtype) for h in (4, hk, hk)]
            for (q, k, v), fmt, cu, sq, sk in ((thd, "thd", (cu_q, cu_k), 200, 129),
                                               (bshd, "bshd", (None, None), 170, 300),
                                               (square, "bshd", (None, None), 300, 300)):
                # (window_left, window_right, bottom_right): no mask, causal both ways, windows
                # (key blocks that no query sees, masked steps on both sides of the band)
                for left, right, br in ((-1, -1, False), (-1, 0, False), (-1, 0, True),
                                        (48, 16, False), (64, 0, True), (-1, 37, True)):
                    call = flash.FlashCall(fmt, fmt, sq, sk, 1 / math.sqrt(d), left, right, br,
                                           0.0, False, True, bwd_family=90)
                    out, lse = flash._fwd_impl(q, k, v, *cu, None, None, call)
                    dout = torch.randn_like(out)
                    for deterministic in (False, True):
                        dq, dk, dv = flash._bwd_impl(
                            dout, q, k, v, out, lse, *cu, None, None,
                            call._replace(deterministic=deterministic))
    torch.cuda.synchronize()
    print("sanitize case done (sm90 backward)", dq.float().abs().sum().item())
    sys.exit(0)
if args.fp8_cast:
    from transformer_fa.kernels import fp8_cast
    assert hasattr(flash._extension(), "fp8_cast_transpose"), "built without the FP8 cast"
    calls = 0
    for dtype in (torch.bfloat16, torch.float16):
        for rows, cols in ((1040, 264), (16, 8)):
            base = torch.randn(rows, cols + 16, device="cuda", dtype=dtype)
            for x in (base[:, :cols].contiguous(), base[:, 16:]):  # and a strided view
                h = torch.randn_like(x)
                for fp8_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                    for act, dbias in (("none", False), ("none", True), ("gelu", False),
                                       ("dgelu", False), ("dgelu", True)):
                        for rowwise in (True, False):
                            for from_amax in (False, True):
                                scalar = torch.full((), 2.0, device="cuda")
                                out = fp8_cast.cast(
                                    x, None if from_amax else scalar, fp8_dtype,
                                    torch.finfo(fp8_dtype).max, rowwise=rowwise,
                                    columnwise=True, amax=torch.zeros(1, device="cuda"),
                                    scale_from_amax=scalar if from_amax else None, dbias=dbias,
                                    gelu=act == "gelu",
                                    dgelu_input=h if act == "dgelu" else None)
                                calls += 1
                    fp8_cast.fold_amax(x, torch.zeros(1, device="cuda"), gelu=act == "gelu",
                                       dgelu_input=h if act == "dgelu" else None)
    torch.cuda.synchronize()
    print("sanitize case done: fp8 casts", calls, out[1].float().abs().sum().item())
    sys.exit(0)
if args.decode:
    # 3 sequences: 1, 3 and 2 new tokens over 1, 300 and 77 cached keys (tails not multiples of
    # a 16-key chunk); 8 query heads on 2 KV heads (row tiles of 4 tokens x 4 heads).
    lens_q, lens_k = [1, 3, 2], [1, 300, 77]
    cu_q = torch.tensor([0, 1, 4, 6], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 1, 301, 378], dtype=torch.int32, device="cuda")
    for d in (int(x) for x in args.dims.split(",")):
        q_thd = torch.randn(7, 8, d, device="cuda", dtype=torch.bfloat16)  # a token past the end
        q_bshd = torch.randn(3, 3, 8, d, device="cuda", dtype=torch.float16)
        for q, fmt in ((q_thd, "thd"), (q_bshd, "bshd")):
            k = torch.randn(3, 320, 2, d, device="cuda", dtype=q.dtype)
            v = torch.randn_like(k)
            for page in (None, 16, 64):
                kk, vv, table = k, v, None
                if page is not None:  # the same rows, as shuffled pages
                    pages = 3 * 320 // page if 320 % page == 0 else None
                    if pages is None:
                        continue
                    order = torch.randperm(pages, device="cuda")
                    kk, vv = (torch.empty_like(t.view(pages, page, 2, d)).index_copy_(
                        0, order, t.reshape(pages, page, 2, d)) for t in (k, v))
                    table = order.view(3, -1).to(torch.int32)
                for left, right in ((-1, -1), (-1, 0), (40, 0)):
                    for splits in (1, 3, 0):
                        call = flash.FlashCall(fmt, "bshd", 3, 320, 1 / math.sqrt(d), left,
                                               right, True, 0.0, False, False)
                        out = flash._decode(q, kk, vv, cu_q if fmt == "thd" else
                                            torch.tensor([0, 1, 4, 6], dtype=torch.int32,
                                                         device="cuda"),
                                            cu_k, table, call, splits)
    torch.cuda.synchronize()
    print("sanitize case done (decode)", out.float().abs().sum().item())
    sys.exit(0)
lens_q, lens_k = [37, 130, 1, 70], [50, 129, 9, 200]
cu_q = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32,
                    device="cuda")
cu_k = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32,
                    device="cuda")
rng = torch.tensor([1234567, 89], dtype=torch.int64, device="cuda")
slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], device="cuda")
# (window_left, window_right, bottom_right, dropout_p, alibi)
# (kernels without dropout / ALiBi take the first two, those with them the rest)
masks = ((-1, -1, False, 0.0, False), (12, 4, True, 0.0, False), (-1, 0, True, 0.1, False),
         (16, 0, False, 0.0, True), (24, 8, True, 0.2, True))
for d in (int(x) for x in args.dims.split(",")):
    for dtype in (torch.bfloat16, torch.float16):
        q = torch.randn(sum(lens_q), 4, d, device="cuda", dtype=dtype)
        k = torch.randn(sum(lens_k), 2, d, device="cuda", dtype=dtype)
        v = torch.randn(sum(lens_k), 2, d, device="cuda", dtype=dtype)
        for left, right, br, p, alibi in masks:
            call = flash.FlashCall("thd", "thd", max(lens_q), max(lens_k), 1 / math.sqrt(d),
                                   left, right, br, p, False, True)
            extra = (rng if p > 0 else None, slopes if alibi else None)
            out, lse = flash._fwd_impl(q, k, v, cu_q, cu_k, *extra, call)
            if args.backward:
                dout = torch.randn_like(out)
                for deterministic in ((False, True) if left == -1 and right == 0 else (False,)):
                    dq, dk, dv = flash._bwd_impl(dout, q, k, v, out, lse, cu_q, cu_k, *extra,
                                                 call._replace(deterministic=deterministic))
        # bshd: 2 sequences of 70 queries and 100 keys, GQA, no mask and causal bottom-right.
        qb = torch.randn(2, 70, 4, d, device="cuda", dtype=dtype)
        kb = torch.randn(2, 100, 2, d, device="cuda", dtype=dtype)
        vb = torch.randn(2, 100, 2, d, device="cuda", dtype=dtype)
        for right, br in ((-1, False), (0, True)):
            call = flash.FlashCall("bshd", "bshd", 70, 100, 1 / math.sqrt(d), -1, right, br,
                                   0.0, False, True)
            out, lse = flash._fwd_impl(qb, kb, vb, None, None, None, None, call)
            if args.backward:
                dout = torch.randn_like(out)
                for deterministic in (False, True):
                    dq, dk, dv = flash._bwd_impl(dout, qb, kb, vb, out, lse, None, None, None,
                                                 None, call._replace(deterministic=deterministic))
torch.cuda.synchronize()
print("sanitize case done", out.float().abs().sum().item(),
      dq.float().abs().sum().item() if args.backward else "")
