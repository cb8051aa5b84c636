"""Markdown tables and a TFLOPS plot from a bench_attention.py results JSON (no GPU needed).

    python benchmarks/report.py benchmarks/results/<gpu>-<date>.json [--readme benchmarks/README.md]

Writes <name>.md and <name>.png beside the JSON (the PNG needs matplotlib). --readme replaces
the block between the results markers in that file with the tables and the plot.
"""
from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from pathlib import Path

OURS = ("FlashAttention", "FusedAttention", "UnfusedDotProductAttention")
PEERS = ("torch:FLASH_ATTENTION", "torch:CUDNN_ATTENTION", "torch:EFFICIENT_ATTENTION")
BACKENDS = OURS + PEERS
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"


def fmt(x, digits=0):
    return "–" if x is None else f"{x:.{digits}f}"


def table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def ratio_table(recs, row_keys, metrics, digits=0):
    """One row per distinct row_keys, one column per backend that ran at least once.
    Cells are the metrics joined by '/'; ours add their ratio to the best peer in brackets."""
    rows = list(dict.fromkeys(tuple(r[k] for k in row_keys) for r in recs))
    ran = dict.fromkeys(r["backend"] for r in recs if r[metrics[0]] is not None)
    # the known backends first, then variants of ours (e.g. "FlashAttention (paged 64)")
    names = [n for n in BACKENDS if n in ran] + [n for n in ran if n not in BACKENDS]
    out = []
    for row in rows:
        by = {r["backend"]: r for r in recs if tuple(r[k] for k in row_keys) == row}
        best = [max((by[p][m] for p in PEERS if p in by and by[p][m] is not None), default=None)
                for m in metrics]
        cells = []
        for name in names:
            vals = [by[name][m] if name in by else None for m in metrics]
            text = " / ".join(fmt(v, digits) for v in vals)
            if name.split(" (")[0] in OURS and vals[0] is not None and any(best):
                text += " (" + " / ".join(f"{v / b:.2f}x" if v and b else "–"
                                          for v, b in zip(vals, best)) + ")"
            cells.append(text)
        out.append(list(row) + cells)
    return table(list(row_keys) + names, out)


def not_run(recs, label="backend"):
    """Distinct reasons for null rows, with counts."""
    count = Counter((r[label], short(r["reason"])) for r in recs if r.get("reason"))
    return "\n".join(f"- {name} ({n} row{'s' * (n > 1)}): {reason}"
                     for (name, reason), n in count.items())


def sdpa_notes(parts):
    """SDPA's 'why not' warnings: the first sentence of each, less the headers, the source
    lines and the kernels that the benchmark itself disabled."""
    out = []
    for part in parts:
        part = re.sub(r"\s*\(Triggered internally at [^)]*\)\.?", "", part).strip()
        part = part.split(". ")[0]
        if part and not part.endswith("because:") and "runtime disabled" not in part:
            out.append(part)
    return out


def short(reason, limit=300):
    """The reason without what varies from row to row (sizes, free memory, source lines)."""
    reason = re.sub(r"out of memory\b.*?(tried to allocate [\d.]+ \w+).*",
                    lambda m: f"out of memory ({m.group(1)})", reason, flags=re.S | re.I)
    parts = reason.split(" | ")
    if len(reason) >= 1000 and len(parts) > 1:  # cut off when recorded: drop the stub
        parts = parts[:-1]
    reason = " ".join(" | ".join(sdpa_notes(parts)).split())
    return reason if len(reason) <= limit else reason[:limit] + " …"


def section(title, intro, body, recs, label="backend"):
    reasons = not_run(recs, label)
    return "\n\n".join(p for p in (f"### {title}", intro, body,
                                   reasons and "Not run:\n" + reasons) if p)


def timing_note(recs):
    """How the rows' calls were timed (records with a ``timing``), by backend; or None."""
    modes = {}
    for r in recs:
        if r.get("timing"):
            modes.setdefault(r["timing"], set()).add(r["backend"])
    if not modes:
        return None
    return "Timed as: " + "; ".join(f"{mode} ({', '.join(sorted(names))})"
                                    for mode, names in sorted(modes.items())) + "."


def markdown(data, png_name=None):
    recs = data["records"]
    case = {c: [r for r in recs if r.get("case", "grid") == c]
            for c in ("grid", "gqa", "varlen", "padded", "overhead")}
    parts = [f"## Attention benchmarks: {data['gpu']}, {data['date']}",
             f"torch {data['torch']}, cuDNN {data['cudnn']}, FlashAttention kernel family "
             f"{data.get('flash_family', 'auto')} (backward: {data.get('flash_bwd_family', 'auto')}). TFLOPS by the FlashAttention "
             "convention (forward 4·b·h·sq·sk·d, halved for causal; backward 2.5x forward), "
             "median of CUDA-event timings" + passes_note(data) + ". Cells are forward / "
             "backward; each of ours adds its ratio to the best PyTorch SDPA backend on the row."]
    for dtype in dict.fromkeys(r["dtype"] for r in case["grid"]):
        grid = [r for r in case["grid"] if r["dtype"] == dtype]
        parts.append(section(f"{dtype}, batch·seqlen = {grid[0]['b'] * grid[0]['s']}, "
                             f"hidden = {grid[0]['h'] * grid[0]['d']} (TFLOPS)", None,
                             ratio_table(grid, ("d", "causal", "s"),
                                         ("fwd_tflops", "bwd_tflops")), grid))
    if png_name:
        parts.append(f"![TFLOPS against sequence length]({png_name})")
    if case["gqa"]:
        g = case["gqa"][0]
        parts.append(section(f"GQA: {g['h']} query / {g['hkv']} kv heads, d = {g['d']} (TFLOPS)",
                             None, ratio_table(case["gqa"], ("causal", "s", "b"),
                                               ("fwd_tflops", "bwd_tflops")), case["gqa"]))
    if case["varlen"]:
        parts.append(varlen_section(case["varlen"], case["padded"]))
    if data["decode"]:
        d = data["decode"][0]
        parts.append(section(
            f"Decode: one query token, {d['hq']} / {d['hkv']} heads, d = {d['d']} "
            "(K+V TB read per second)", timing_note(data["decode"]),
            ratio_table(data["decode"], ("b", "sk"), ("kv_tb_per_s",), digits=2), data["decode"]))
    if case["overhead"]:
        o = case["overhead"][0]
        rows = [[r["backend"], fmt(r["call_us"], 1), fmt(r["bare_us"], 1),
                 fmt(r["overhead_us"], 1)] for r in case["overhead"]]
        parts.append(section(
            f"Module overhead: b={o['b']} s={o['s']} h={o['h']} d={o['d']} causal, "
            "forward host time per call (µs)", None,
            table(["backend", "DotProductAttention", "bare backend run", "overhead"], rows),
            case["overhead"]))
    if data["layer"]:
        parts.append(layer_section(data["layer"]))
    return "\n\n".join(parts) + "\n"


def passes_note(data):
    """How the grid's times were taken when it ran more than one pass."""
    n = data.get("grid_repeats", 1)
    return (f"; the grid ran {n} passes (each row's backends side by side in every pass) and "
            "each grid cell is the median time over the passes") if n > 1 else ""


def varlen_section(varlen, padded):
    v = varlen[0]
    rows = []
    for r in varlen:
        p = next((x for x in padded if (x["backend"], x["causal"]) == (r["backend"], r["causal"])),
                 {})
        speedup = [fmt(p[f"{x}_ms"] / r[f"{x}_ms"], 2) + "x" if r[f"{x}_ms"] and p.get(f"{x}_ms")
                   else "–" for x in ("fwd", "bwd")]
        rows.append([r["backend"], r["causal"],
                     f"{fmt(r['fwd_tflops'])} / {fmt(r['bwd_tflops'])}",
                     f"{fmt(p.get('fwd_tflops'))} / {fmt(p.get('bwd_tflops'))}",
                     " / ".join(speedup)])
    return section(
        f"Varlen: thd with {v['b']} random lengths up to {v['s']} ({v['tokens']} tokens), "
        f"h = {v['h']}, d = {v['d']}, against the same batch padded to {v['s']} with a padding mask",
        "TFLOPS count the real tokens only in both columns; speedup = padded time / thd time.",
        table(["backend", "causal", "thd fwd / bwd", "padded fwd / bwd", "thd speedup"], rows),
        varlen + padded)


def layer_section(layer):
    ref = next((r["tokens_per_s"] for r in layer if r["model"].startswith("torch")), None)
    rows = [[r["model"], r["attn_backend"] or "–", fmt(r["step_ms"], 1),
             fmt(max(r["step_ms_each"]), 1) if r.get("step_ms_each") else "–",
             fmt(r["tokens_per_s"]),
             fmt(r["tokens_per_s"] / ref, 2) + "x" if r["tokens_per_s"] and ref else "–",
             fmt(r["peak_mem_gb"], 1)] for r in layer]
    x = layer[0]
    return section(
        f"TransformerLayer training step: {x['layers']} layers, hidden {x['hidden']}, "
        f"{x['heads']} heads, ffn {x['ffn']}, b={x['b']}, s={x['s']}, {x['dtype']}",
        f"Forward + backward + {x.get('optimizer', 'AdamW')} step (the same optimizer for "
        "both models); the same pre-LayerNorm GPT block in plain PyTorch "
        "(F.scaled_dot_product_attention, causal) is the reference. Step ms: the mean of the "
        "timed steps (wall time); slowest step: the longest step's span on the GPU timeline.",
        table(["model", "attention", "step ms", "slowest step ms", "tokens/s", "vs torch",
               "peak GB"], rows),
        layer, label="model")


def plot(data, png_path):
    """TFLOPS against s: one panel per (d, causal, direction), one line per backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = [r for r in data["records"] if r.get("case", "grid") == "grid"]
    grid = [r for r in grid if r["dtype"] == grid[0]["dtype"]]
    dims = sorted({r["d"] for r in grid})
    cols = [(c, x) for c in (False, True) for x in ("fwd", "bwd")]
    fig, axes = plt.subplots(len(dims), len(cols), figsize=(4 * len(cols), 3 * len(dims)),
                             squeeze=False, sharex=True)
    for ax, (d, (causal, x)) in zip(axes.flat, [(d, c) for d in dims for c in cols]):
        for name in BACKENDS:
            pts = sorted((r["s"], r[f"{x}_tflops"]) for r in grid if r["backend"] == name
                         and r["d"] == d and r["causal"] == causal
                         and r[f"{x}_tflops"] is not None)
            if pts:
                ax.plot(*zip(*pts), marker="o", ms=3, label=name, color=f"C{BACKENDS.index(name)}",
                        linestyle="-" if name in OURS else "--")
        ax.set_xscale("log", base=2)
        seqlens = sorted({r["s"] for r in grid})
        ax.set_xticks(seqlens, [f"{s // 1024}k" if s >= 1024 else str(s) for s in seqlens])
        ax.set_title(f"d={d} {'causal' if causal else 'no mask'} {x}", fontsize=9)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel("sequence length")
    for ax in axes[:, 0]:
        ax.set_ylabel("TFLOPS")
    handles = {h.get_label(): h for ax in axes.flat for h in ax.get_lines()}
    if handles:
        fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=len(handles),
                   fontsize=8)
    fig.suptitle(f"{data['gpu']} {grid[0]['dtype']}, {data['date']}")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(png_path, dpi=90)
    plt.close(fig)


def write(json_path, readme=None):
    """Write the .md (and .png if matplotlib is there) beside json_path; return the markdown."""
    json_path = Path(json_path)
    data = json.loads(json_path.read_text())
    png = json_path.with_suffix(".png")
    if not any(r.get("case", "grid") == "grid" for r in data["records"]):
        png = None  # the plot is of the grid part, which this run left out
    else:
        try:
            plot(data, png)
        except ImportError:
            png = None
    text = markdown(data, png and png.name)
    json_path.with_suffix(".md").write_text(text)
    if readme:
        readme = Path(readme)
        rel = f"{json_path.parent.name}/" if json_path.parent.resolve() != readme.parent.resolve() \
            else ""
        block = markdown(data, png and rel + png.name)
        old = readme.read_text()
        pattern = re.compile(re.escape(BEGIN) + ".*" + re.escape(END), re.S)
        readme.write_text(pattern.sub(lambda _: f"{BEGIN}\n{block}{END}", old))
    return text


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("json")
    ap.add_argument("--readme", help="a Markdown file with the results markers to update")
    args = ap.parse_args()
    print(write(args.json, args.readme))
