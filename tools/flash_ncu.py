"""Nsight Compute figures for one attention call: ours (the flash extension, a chosen kernel
family) or torch's cuDNN / FA2 SDPA on the same shape, for the "why is this row slower" question
that a benchmark cannot answer. For the GPU machine:

    python tools/flash_ncu.py fwd:256:nc:4096 bwd:128:c:4096 fwd:256:nc:4096:cudnn [--out DIR]
    python tools/flash_ncu.py decode:8:32768 decode:8:32768:cudnn
    python tools/flash_ncu.py decode:1:4096:nolens decode:1:4096:paged64

A case is direction:head_dim:mask:seqlen[:who]: direction fwd or bwd; mask nc (no mask) or c
(causal); who sm90 (default), sm80, cudnn or fa2. The shape is the benchmark grid's (bf16,
batch * seqlen = 16k, hidden 2048). A decode case is decode:batch:cache_len[:who], who ours
(default: flash_attn_with_kvcache with cache_seqlens, the split-KV decode kernel and its merge),
nolens (ours without cache_seqlens: the lengths known on the host), pagedN (ours through a block
table of N-key pages in a shuffled order, N a multiple of 16 dividing cache_len: the benchmark's
paged rows) or cudnn: one query token, 32 query / 8 KV heads, d128, bf16, a contiguous cache
(the benchmark's decode rows). Each case runs in a child process under ncu, which
profiles every kernel of one call after a warm-up call (the backward's dsum and conversion
kernels too), between cudaProfilerStart and Stop: process-wide, since torch's backward
launches from autograd's own thread, outside the caller's NVTX range (where ncu found no
kernel of cuDNN's backward). It collects the SpeedOfLight, ComputeWorkloadAnalysis,
MemoryWorkloadAnalysis, WarpStateStats, LaunchStats and Occupancy sections. Printed per kernel:
duration, SM / memory / DRAM / L1 throughput, registers, achieved occupancy, issue slots, the
tensor-pipe metrics that ncu reports, and the six largest warp stall reasons (cycles per issued
instruction). The raw CSV of each case goes to DIR (default: none). --metrics adds raw metric
names (an unknown name makes ncu fail).

--source N adds the SourceCounters section and ncu's source view: per kernel, the N source
lines with the most warp-stall samples (their share of samples and of executed instructions,
and their largest stall reasons), the SASS opcodes by executed instructions, and the N SASS
instructions with the most samples (their place in the kernel's code and their two largest
stall reasons). Source lines need a build with TRANSFORMER_FA_LINEINFO=1 (setup.py adds
-lineinfo; the code is the same); without it (cuDNN's kernels) the SASS views still show, from
ncu's SASS-only page. The report (.ncu-rep) and both source CSVs go to DIR too.
"""
import argparse
import collections
import csv
import io
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

SECTIONS = ("SpeedOfLight", "ComputeWorkloadAnalysis", "MemoryWorkloadAnalysis",
            "WarpStateStats", "LaunchStats", "Occupancy")
# (label, raw metric name) printed when the CSV has them
SUMMARY = (
    ("duration us", "gpu__time_duration.sum"),
    ("SM throughput %", "sm__throughput.avg.pct_of_peak_sustained_elapsed"),
    ("memory throughput %", "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed"),
    ("DRAM throughput %", "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed"),
    ("L1/shared throughput %", "l1tex__throughput.avg.pct_of_peak_sustained_active"),
    ("registers / thread", "launch__registers_per_thread"),
    ("achieved occupancy %", "sm__warps_active.avg.pct_of_peak_sustained_active"),
    ("issue slots busy %", "sm__inst_issued.avg.pct_of_peak_sustained_active"),
    ("cycles / issued inst", "smsp__average_warp_latency_per_inst_issued.ratio"),
)
STALL = re.compile(r"smsp__average_warps?(?:_latency)?_issue_stalled_(\w+?)_per_issue_active\.ratio")
# the tensor pipes' use; a report read back has every sub-metric (min, max, sum, elapsed), the
# average over active cycles says it
TENSOR = re.compile(r"pipe_tensor.*\.avg\.pct_of_peak_sustained_active$")


def parse_decode_case(text):
    parts = text.split(":")
    if len(parts) not in (3, 4) or not all(x.isdigit() and int(x) > 0 for x in parts[1:3]):
        raise argparse.ArgumentTypeError(
            f"case {text!r}: expected decode:batch:cache_len[:who], e.g. decode:8:32768")
    who = parts[3] if len(parts) == 4 else "ours"
    sk = int(parts[2])
    page = who[len("paged"):] if who.startswith("paged") else ""
    page_size = int(page) if page.isdigit() else 0  # 0: a contiguous cache
    paged_ok = page_size > 0 and page_size % 16 == 0 and sk % page_size == 0
    if who not in ("ours", "nolens", "cudnn") and not paged_ok:
        raise argparse.ArgumentTypeError(
            f"case {text!r}: a decode case's who is ours, nolens, pagedN (N a multiple of 16 "
            "dividing cache_len) or cudnn")
    case = dict(direction="decode", b=int(parts[1]), sk=sk, who=who)
    if paged_ok:
        case["page_size"] = page_size
    return case


def parse_case(text):
    if text.startswith("decode:"):
        return parse_decode_case(text)
    parts = text.split(":")
    if len(parts) not in (4, 5) or parts[0] not in ("fwd", "bwd") or parts[2] not in ("nc", "c"):
        raise argparse.ArgumentTypeError(
            f"case {text!r}: expected direction:head_dim:mask:seqlen[:who], e.g. fwd:128:c:4096")
    who = parts[4] if len(parts) == 5 else "sm90"
    if who not in ("sm90", "sm80", "cudnn", "fa2"):
        raise argparse.ArgumentTypeError(f"case {text!r}: who must be sm90, sm80, cudnn or fa2")
    d, s = (int(x) if x.isdigit() else 0 for x in (parts[1], parts[3]))
    if d % 8 or not 0 < d <= 256 or s <= 0 or 16384 % s:
        raise argparse.ArgumentTypeError(f"case {text!r}: head_dim a multiple of 8 up to 256, "
                                         "seqlen a divisor of 16384")
    return dict(direction=parts[0], d=d, causal=parts[2] == "c", s=s, who=who)


def run_case(case):
    """The child: one warm-up call, then one between cudaProfilerStart and Stop (all threads),
    which ncu profiles."""
    import torch

    if case["direction"] == "decode":
        profile_second_call(decode_call(case))
        return
    d, s, causal, who = case["d"], case["s"], case["causal"], case["who"]
    b, h = 16384 // s, 2048 // d
    q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
                   for _ in range(4))
    scale = 1 / math.sqrt(d)
    if who in ("sm90", "sm80"):
        import transformer_fa_flash as ext

        family = 90 if who == "sm90" else 80
        right = 0 if causal else -1

        def forward():
            return ext.fwd(q, k, v, None, None, 0, 0, s, s, scale, -1, right, False, True, 0.0,
                           None, None, family)

        out, lse = forward()
        call = forward if case["direction"] == "fwd" else (
            lambda: ext.bwd(do, q, k, v, out, lse, None, None, 0, 0, s, s, scale, -1, right,
                            False, 0.0, None, None, False, None, family))
    else:
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = SDPBackend.CUDNN_ATTENTION if who == "cudnn" else SDPBackend.FLASH_ATTENTION
        qt, kt, vt = (x.transpose(1, 2).requires_grad_() for x in (q, k, v))
        with sdpa_kernel(backend):
            o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

        def call():
            with sdpa_kernel(backend):
                if case["direction"] == "fwd":
                    return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                return torch.autograd.grad(o, (qt, kt, vt), do.transpose(1, 2),
                                           retain_graph=True)
    profile_second_call(call)


def profile_second_call(call):
    """A warm-up call, then one between cudaProfilerStart and Stop, which ncu profiles."""
    import torch

    call()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    call()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def decode_call(case):
    """One decode step of a decode case: ours through flash_attn_with_kvcache (with or without
    cache_seqlens, or through a block table), or torch's cuDNN SDPA on [b, h, s, d] views of the
    same bshd tensors (GQA)."""
    import torch

    b, sk = case["b"], case["sk"]
    q = torch.randn(b, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, sk, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    who = case["who"]
    if who != "cudnn":
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        import transformer_fa as tfa

        if who == "nolens":
            return lambda: tfa.flash_attn_with_kvcache(q, k, v)
        lens = torch.full((b,), sk, dtype=torch.int32, device="cuda")
        if "page_size" in case:
            from benchmarks.bench_attention import shuffled_page_pools

            (pool_k, pool_v), table = shuffled_page_pools(k, v, case["page_size"])
            return lambda: tfa.flash_attn_with_kvcache(q, pool_k, pool_v, cache_seqlens=lens,
                                                       block_table=table)
        return lambda: tfa.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens)
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

    def call():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
    return call


def profile(text, metrics, report=None):
    """ncu over the child: the raw CSV (one row per kernel), or None with ncu's output. With a
    report path (the source view) ncu writes the report with the source counters and the
    sources, and the raw CSV is read back from it."""
    sections = SECTIONS + (("SourceCounters",) if report else ())
    cmd = ["ncu", "--profile-from-start", "off"]
    cmd += ["-f", "-o", str(report), "--import-source", "yes"] if report else [
        "--csv", "--page", "raw", "--print-units", "base"]
    for section in sections:
        cmd += ["--section", section]
    if metrics:
        cmd += ["--metrics", metrics]
    cmd += [sys.executable, os.path.abspath(__file__), "--run", text]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if report and done.returncode == 0:
        done = subprocess.run(["ncu", "-i", f"{report}.ncu-rep", "--csv", "--page", "raw",
                               "--print-units", "base"], capture_output=True, text=True)
    lines = done.stdout.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if done.returncode != 0 or start is None:
        return None, done.stdout[-3000:] + done.stderr[-3000:]
    return "\n".join(lines[start:]), None


def source_view(report, view):
    """ncu's source page of a report as CSV: view "cuda,sass" (every kernel with line info:
    its CUDA lines, the SASS under each) or "sass" (every kernel's SASS alone)."""
    done = subprocess.run(["ncu", "-i", f"{report}.ncu-rep", "--csv", "--page", "source",
                           "--print-source", view], capture_output=True, text=True)
    return done.stdout if done.returncode == 0 else None


def _count(text):
    text = text.replace(",", "")
    try:
        return float(text)
    except ValueError:
        return 0.0


def _largest(stalls, total, n):
    """The n largest stall reasons as (reason, share of total %), zero ones left out."""
    return [(reason, 100 * v / total) for reason, v in
            sorted(stalls.items(), key=lambda item: -item[1])[:n] if v]


def summarize_source(text, top):
    """Per kernel of ncu's source page CSV, either view: "cuda,sass" (blocks of "File Path",
    "Function Name", a header from "Line No", then source-line rows and SASS rows, the SASS
    repeated under each file) or "sass" (blocks of "Kernel Name", a header from "Address", SASS
    rows, a kernel's block at times repeated). Gives
    - lines: the `top` source lines by warp-stall samples as (file:line, share of samples %,
      share of executed instructions %, its three largest stall reasons with their shares %);
      none from the SASS view;
    - opcodes: the SASS opcodes by executed instructions as (opcode, millions executed,
      share %, share of samples %);
    - hottest: the `top` SASS instructions by samples as (its index in the kernel's code,
      the instruction, share of samples %, its two largest stall reasons).
    Shares are of the kernel's totals (its SASS rows, each address counted once)."""
    kernels = {}
    path = function = header = None
    for row in csv.reader(io.StringIO(text)):
        if not row:
            continue
        if row[0] == "File Path":
            path = row[1]
        elif row[0] in ("Function Name", "Kernel Name"):
            function = row[1]
        elif row[0] in ("Line No", "Address"):
            header = row
        elif header and function and len(row) == len(header):
            values = dict(zip(header, row))
            k = kernels.setdefault(function, dict(lines=[], sass={}))
            samples = _count(values.get("Warp Stall Sampling (All Samples)", ""))
            executed = _count(values.get("Instructions Executed", ""))
            stalls = {name[len("stall_"):]: _count(v) for name, v in values.items()
                      if name.startswith("stall_") and "Not Issued" not in name}
            at = header.index("Address")
            if header[0] == "Line No" and row[0]:  # a source line
                k["lines"].append((f"{Path(path or '?').name}:{row[0]}", samples, executed,
                                   stalls))
            elif row[at].startswith("0x") and row[at] not in k["sass"]:  # a SASS instruction
                k["sass"][row[at]] = (row[at + 1].strip(), samples, executed, stalls)
    out = {}
    for function, k in kernels.items():
        sass = list(k["sass"].values())
        ops, op_samples = collections.Counter(), collections.Counter()
        for instruction, samples, executed, _ in sass:
            words = instruction.split()
            words = words[1:] if words and words[0].startswith("@") else words
            opcode = words[0].split(".")[0] if words else "?"
            ops[opcode] += executed
            op_samples[opcode] += samples
        # shares of the kernel's totals, the SASS rows' (a line's count includes the code
        # inlined into it, which its own lines count again: lines overlap, SASS rows do not)
        samples = sum(op_samples.values()) or sum(line[1] for line in k["lines"]) or 1.0
        executed = sum(ops.values()) or sum(line[2] for line in k["lines"]) or 1.0
        lines = sorted(k["lines"], key=lambda line: -line[1])[:top]
        hottest = sorted(range(len(sass)), key=lambda i: -sass[i][1])[:top]
        out[function] = dict(
            lines=[(where, 100 * s / samples, 100 * e / executed, _largest(stalls, samples, 3))
                   for where, s, e, stalls in lines],
            opcodes=[(op, n / 1e6, 100 * n / executed, 100 * op_samples[op] / samples)
                     for op, n in ops.most_common(12)],
            hottest=[(i, sass[i][0], 100 * sass[i][1] / samples,
                      _largest(sass[i][3], samples, 2)) for i in hottest if sass[i][1]])
    return out


def summarize(raw):
    """Rows of (kernel, {label: value}) from ncu's raw CSV (header, units row, one row a
    kernel)."""
    rows = list(csv.reader(io.StringIO(raw)))
    header, data = rows[0], [r for r in rows[2:] if len(r) == len(rows[0])]
    out = []
    for row in data:
        values = dict(zip(header, row))
        summary = {}
        for label, name in SUMMARY:
            if values.get(name):
                value = float(values[name].replace(",", ""))
                summary[label] = value / 1000 if name == "gpu__time_duration.sum" else value
        for name, value in values.items():
            if TENSOR.search(name) and value:
                summary[name] = float(value.replace(",", ""))
        stalls = sorted(((float(v.replace(",", "")), STALL.match(n).group(1))
                         for n, v in values.items() if STALL.match(n) and v), reverse=True)
        summary["top stalls"] = ", ".join(f"{reason} {value:.2f}" for value, reason in stalls[:6])
        out.append((values.get("Kernel Name", "?")[:80], summary))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("cases", nargs="*", help="direction:head_dim:mask:seqlen[:who]")
    ap.add_argument("--run", help=argparse.SUPPRESS)  # the child: one case
    ap.add_argument("--out", help="directory for each case's raw CSV")
    ap.add_argument("--metrics", default="", help="extra raw metric names, comma separated")
    ap.add_argument("--source", type=int, default=0, metavar="N",
                    help="also the source view: the N lines with the most stall samples and "
                         "the SASS opcodes, per kernel (lines need TRANSFORMER_FA_LINEINFO=1)")
    args = ap.parse_args()
    try:
        if args.run:
            run_case(parse_case(args.run))
            return
        cases = [(text, parse_case(text)) for text in args.cases]
    except argparse.ArgumentTypeError as exc:
        ap.error(str(exc))
    if not cases:
        ap.error("give at least one case, e.g. fwd:256:nc:4096")
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    for text, case in cases:
        report = None
        if args.source:
            report = (out or Path(tempfile.mkdtemp())) / f"ncu-{text.replace(':', '-')}"
        raw, error = profile(text, args.metrics, report)
        shape = (f"b={case['b']}, 32 / 8 heads, d128" if case["direction"] == "decode"
                 else f"b={16384 // case['s']}, h={2048 // case['d']}")
        print(f"== {text} ({shape})", flush=True)
        if raw is None:
            print("ncu failed:\n" + error)
            continue
        if out:
            (out / f"ncu-{text.replace(':', '-')}.csv").write_text(raw)
        for kernel, summary in summarize(raw):
            print(f"  {kernel}")
            for label, value in summary.items():
                shown = f"{value:.1f}" if isinstance(value, float) else value
                print(f"    {label}: {shown}")
        if report:
            print_source(report, out, text, args.source)


def print_source(report, out, text, top):
    """Each kernel's source lines (from the cuda,sass view, kernels with line info) and SASS
    views (from the SASS view, every kernel)."""
    pages = {}
    for view, suffix in (("cuda,sass", "source"), ("sass", "sass")):
        pages[view] = source_view(report, view)
        if out and pages[view] is not None:
            (out / f"ncu-{text.replace(':', '-')}-{suffix}.csv").write_text(pages[view])
    if pages["cuda,sass"] is None and pages["sass"] is None:
        print("  (ncu gave no source view)")
        return
    lines = summarize_source(pages["cuda,sass"] or "", top)
    sass = summarize_source(pages["sass"] or "", top)
    for function in list(sass) + [f for f in lines if f not in sass]:
        summary = sass.get(function) or lines[function]
        print(f"  source view: {function[:100]}")
        if lines.get(function, {}).get("lines"):
            print("    line: samples % / instructions %, largest stalls")
            for where, samples, executed, stalls in lines[function]["lines"]:
                print(f"      {where}: {samples:.1f} / {executed:.1f}  ({_reasons(stalls)})")
        else:
            print("    (no line info: no source lines)")
        print("    SASS opcode: million executed, instructions %, samples %")
        for op, millions, share, samples in summary["opcodes"]:
            print(f"      {op}: {millions:.2f}M, {share:.1f}, {samples:.1f}")
        print("    hottest SASS: index in the code, samples %, instruction, largest stalls")
        for index, instruction, samples, stalls in summary["hottest"]:
            print(f"      {index:6d} {samples:5.1f}  {instruction[:64]}  ({_reasons(stalls)})")


def _reasons(stalls):
    return ", ".join(f"{reason} {share:.1f}" for reason, share in stalls)


if __name__ == "__main__":
    main()
