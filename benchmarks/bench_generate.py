"""Decode tokens/s of examples/generate.py's loop: transformer_fa with InferenceParams against
the same weights in plain PyTorch (F.scaled_dot_product_attention, a KV cache grown with
torch.cat every step).

    python benchmarks/bench_generate.py --checkpoint gpt.pt --device cuda --batch-sizes 1 8
    python benchmarks/bench_generate.py --device cpu --new-tokens 8   # the toy model, smoke run

The same model (generate.py's: a train_gpt.py checkpoint or the toy counting model), the same
prompts (generate.py's, repeated to the batch size), greedy decoding. Before timing, the plain
model is run on transformer_fa's generated tokens and every step's logits are compared.
Writes ``<device>-<date>-generate.json`` and ``.md`` to --out-dir.
"""
import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT))
import generate  # noqa: E402  (examples/generate.py)

ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "swiglu": lambda x: F.silu(x.chunk(2, -1)[0]) * x.chunk(2, -1)[1],
}


def norm(x, kind, weight, bias, eps):
    if kind == "RMSNorm":
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps).to(x.dtype) * weight
    return F.layer_norm(x, x.shape[-1:], weight, bias, eps)


class PlainBlock:
    """TransformerLayer (pre-norm self attention with RoPE and GQA, then the MLP; no dropout)
    in plain PyTorch, on the layer's own weights (shared, not copied)."""

    def __init__(self, layer):
        attn, mlp = layer.self_attention, layer.layernorm_mlp
        qkv = attn.layernorm_qkv
        if getattr(qkv, "zero_centered_gamma", False) or not attn.input_layernorm:
            raise ValueError("PlainBlock reads pre-norm layers without zero_centered_gamma")
        if mlp.activation not in ACTIVATIONS:
            raise ValueError(f"PlainBlock: activation {mlp.activation!r} is not one of "
                             f"{sorted(ACTIVATIONS)}")
        self.heads, self.groups = attn.num_attention_heads, attn.num_gqa_groups
        self.head_dim = attn.hidden_size_per_attention_head
        self.attn_norm = (qkv.normalization, qkv.layer_norm_weight,
                          getattr(qkv, "layer_norm_bias", None), qkv.eps)
        self.mlp_norm = (mlp.normalization, mlp.layer_norm_weight,
                         getattr(mlp, "layer_norm_bias", None), mlp.eps)
        self.qkv = self._qkv_weights(qkv, attn.qkv_weight_interleaved)
        self.proj = (attn.proj.weight, getattr(attn.proj, "bias", None))
        self.fc1 = (mlp.fc1_weight, getattr(mlp, "fc1_bias", None))
        self.fc2 = (mlp.fc2_weight, getattr(mlp, "fc2_bias", None))
        self.act = ACTIVATIONS[mlp.activation]

    def _qkv_weights(self, qkv, interleaved):
        """(weight, bias) of q, k and v: separate parameters, or split from the fused one
        (interleaved: per group its query heads, its key, its value; else all queries,
        all keys, all values)."""
        if not hasattr(qkv, "weight"):
            return [(getattr(qkv, f"{n}_weight"), getattr(qkv, f"{n}_bias", None))
                    for n in ("query", "key", "value")]
        parts = [self.heads // self.groups, 1, 1]

        def split(t):
            if t is None:
                return [None] * 3
            rows = t.shape[1:]
            shape = ((self.groups, sum(parts)) if interleaved else (sum(parts), self.groups))
            grouped = t.view(*shape, self.head_dim, *rows)
            pieces = grouped.split(parts, dim=1 if interleaved else 0)
            return [(p if interleaved else p.transpose(0, 1)).reshape(-1, *rows) for p in pieces]
        return list(zip(split(qkv.weight), split(getattr(qkv, "bias", None))))

    def __call__(self, x, cos, sin, cache, mask):
        """x [b, s, hidden]; cos, sin [b, s, 1, d]; cache (k, v) [b, groups, L, d] or None;
        mask bool [b, 1, s, L + s] (True: attend). Returns x and the grown cache."""
        b, s, _ = x.shape
        h = norm(x, *self.attn_norm)
        q, k, v = (F.linear(h, w, bias).view(b, s, -1, self.head_dim) for w, bias in self.qkv)
        q, k = (t * cos + torch.cat((-t.chunk(2, -1)[1], t.chunk(2, -1)[0]), -1) * sin
                for t in (q, k))
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if cache is not None:
            k, v = torch.cat((cache[0], k), 2), torch.cat((cache[1], v), 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        x = x + F.linear(out.transpose(1, 2).reshape(b, s, -1), *self.proj)
        h = norm(x, *self.mlp_norm)
        return x + F.linear(self.act(F.linear(h, *self.fc1)), *self.fc2), (k, v)


class PlainGPT:
    """generate.py's model (TinyGPT or CheckpointGPT) in plain PyTorch, on its weights."""

    def __init__(self, model):
        if isinstance(model, generate.CheckpointGPT):
            gpt = model.gpt
            layers, self.embed = gpt.layers, gpt.embed.weight
            final = gpt.final_norm
            self.final_norm = (final.normalization, final.weight, getattr(final, "bias", None), final.eps)
            self.head = (gpt.embed.weight, None)
        else:
            layers, self.embed, self.final_norm = model.layers, model.embed.weight, None
            self.head = (model.head.weight, model.head.bias)
        table = model.rope.reshape(model.rope.shape[0], -1).float()
        self.cos, self.sin = table.cos().to(self.embed.dtype), table.sin().to(self.embed.dtype)
        self.blocks = [PlainBlock(layer) for layer in layers]

    def __call__(self, tokens, positions, caches, mask):
        """tokens, positions [b, s] -> (logits [b, s, vocab], the grown caches)."""
        x = F.embedding(tokens, self.embed)
        cos, sin = self.cos[positions][:, :, None], self.sin[positions][:, :, None]
        grown = []
        for block, cache in zip(self.blocks, caches):
            x, cache = block(x, cos, sin, cache, mask)
            grown.append(cache)
        if self.final_norm is not None:
            x = norm(x, *self.final_norm)
        return F.linear(x, *self.head), grown


def plain_generate(plain, prompts, new_tokens, forced=None):
    """generate.generate's loop on the plain model: the prompts right-padded into one prefill
    (a key mask hides the padding), then one token per step with the caches grown by
    torch.cat. Greedy, or fed ``forced`` ``[b, new_tokens]`` tokens instead. Returns the
    logits ``[b, vocab]`` of every step and the timing (as generate.generate's)."""
    device = plain.embed.device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    b, lengths = len(prompts), torch.tensor([len(p) for p in prompts], device=device)
    longest = max(len(p) for p in prompts)
    with torch.no_grad():
        sync()
        start = time.perf_counter()
        tokens = generate.pack(prompts, "bshd", device)
        valid = torch.arange(longest, device=device) < lengths[:, None]  # [b, L]
        causal = torch.ones(longest, longest, dtype=torch.bool, device=device).tril()
        positions = torch.arange(longest, device=device).expand(b, -1)
        logits, caches = plain(tokens, positions, [None] * len(plain.blocks),
                               (causal & valid[:, None, :])[:, None])
        logits = logits[torch.arange(b, device=device), lengths - 1]
        sync()
        prefill_s = time.perf_counter() - start
        all_logits = [logits]
        start = time.perf_counter()
        for step in range(new_tokens - 1):
            token = logits.argmax(-1) if forced is None else forced[:, step]
            valid = torch.cat((valid, valid.new_ones(b, 1)), 1)
            logits, caches = plain(token[:, None], (lengths + step)[:, None], caches,
                                   valid[:, None, None])
            logits = logits[:, 0]
            all_logits.append(logits)
        sync()
        decode_s = time.perf_counter() - start
    return all_logits, dict(prefill_s=prefill_s, decode_s=decode_s,
                            decode_tokens=b * (new_tokens - 1))


def check_plain_matches(model, plain, prompts, new_tokens):
    """Run both models (plain one fed transformer_fa's tokens); returns the largest logit
    difference and raises if it exceeds generate.py's tolerance."""
    max_seqlen = max(map(len, prompts)) + new_tokens
    params = generate.make_params(model, len(prompts), max_seqlen, plain.embed.dtype)
    seqs, ours, _ = generate.generate(model, prompts, new_tokens, params, progress=False)
    forced = torch.tensor([seqs[i][len(p):] for i, p in enumerate(prompts)],
                          device=plain.embed.device)
    theirs, _ = plain_generate(plain, prompts, new_tokens, forced)
    worst = 0.0
    for step, (a, b) in enumerate(zip(ours, theirs)):
        err = (a.float() - b.float()).abs().max().item()
        allowed = generate.TOLERANCE[a.dtype] * max(1.0, b.float().abs().max().item())
        if err > allowed:
            raise AssertionError(f"step {step}: plain PyTorch logits differ from transformer_fa's "
                                 f"by {err:.3g} (allowed {allowed:.3g})")
        worst = max(worst, err)
    return worst


def decode_rate(timing):
    return timing["decode_tokens"] / timing["decode_s"]


def bench_batch(model, plain, prompts, args):
    """Best decode tokens/s (and its prefill ms) of each implementation over --repeats runs,
    after one warm-up run each."""
    max_seqlen = max(map(len, prompts)) + args.new_tokens

    def ours(cuda_graph):
        params = generate.make_params(model, len(prompts), max_seqlen, plain.embed.dtype,
                                      cuda_graph=cuda_graph)

        def run():  # a new graph per run: its warm-up and capture are in the decode time
            params.reset()
            return generate.generate(model, prompts, args.new_tokens, params,
                                     cuda_graph=cuda_graph, progress=False)[2]
        return run

    def theirs():
        return plain_generate(plain, prompts, args.new_tokens)[1]

    row = {"batch": len(prompts), "new_tokens": args.new_tokens,
           "prompt_lengths": [len(p) for p in prompts]}
    runs = [("transformer_fa", ours(False)), ("plain_sdpa_cat", theirs)]
    if plain.embed.device.type == "cuda":
        runs.append(("transformer_fa_cuda_graph", ours(True)))
    for name, run in runs:
        run()
        best = max((run() for _ in range(args.repeats)), key=decode_rate)
        row[name] = {"decode_tokens_per_s": decode_rate(best),
                     "prefill_ms": best["prefill_s"] * 1e3}
    plain_rate = row["plain_sdpa_cat"]["decode_tokens_per_s"]
    for name in ("transformer_fa", "transformer_fa_cuda_graph"):
        if name in row:
            row[name]["speedup"] = row[name]["decode_tokens_per_s"] / plain_rate
    return row


def device_name(device):
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or "cpu"


def markdown(data):
    lines = ["# Decode tokens/s: transformer_fa InferenceParams vs plain PyTorch (SDPA, "
             "torch.cat KV cache)", "",
             f"{data['device']}, {data['date']}, torch {data['torch']}, {data['dtype']}, model: "
             f"{data['model']}; greedy; the plain model's logits match transformer_fa's "
             f"(max difference {data['max_logit_difference']:.2e})", "",
             "transformer_fa with --cuda-graph: the decode step captured in a CUDA graph (the "
             "warm-up step and the capture are inside the timed loop). The plain model's cache "
             "grows by torch.cat: a new shape every step, so it has no graph.", "",
             "| batch | new tokens | transformer_fa tok/s | transformer_fa, CUDA graph tok/s | "
             "plain tok/s | prefill ms (ours / plain) |", "|---|---|---|---|---|---|"]

    def rate(r, name):
        if name not in r:
            return "-"
        cell = f"{r[name]['decode_tokens_per_s']:.0f}"
        return cell + (f" ({r[name]['speedup']:.2f}x)" if "speedup" in r[name] else "")
    for r in data["rows"]:
        ours, plain = r["transformer_fa"], r["plain_sdpa_cat"]
        lines.append(f"| {r['batch']} | {r['new_tokens']} | {rate(r, 'transformer_fa')} | "
                     f"{rate(r, 'transformer_fa_cuda_graph')} | {rate(r, 'plain_sdpa_cat')} | "
                     f"{ours['prefill_ms']:.2f} / {plain['prefill_ms']:.2f} |")
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", help="a train_gpt.py checkpoint (default: the toy model)")
    p.add_argument("--prompt", action="append", help="with --checkpoint (repeatable)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--train-steps", type=int, default=40, help="the toy model's training")
    p.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args(argv)
    if args.new_tokens < 2 or args.repeats < 1 or min(args.batch_sizes) < 1:
        p.error("--new-tokens must be >= 2 (one prefill and at least one decode step), "
                "--repeats and --batch-sizes >= 1")
    return args


def main(argv=None):
    """Runs the benchmark; returns the path of the JSON file."""
    args = parse_args(argv)
    gen_argv = ["--device", args.device, "--new-tokens", str(args.new_tokens),
                "--train-steps", str(args.train_steps)]
    if args.dtype:
        gen_argv += ["--dtype", args.dtype]
    if args.checkpoint:
        gen_argv += ["--checkpoint", args.checkpoint]
    for text in args.prompt or []:
        gen_argv += ["--prompt", text]
    gen_args = generate.parse_args(gen_argv)
    model, prompts, _ = generate.build_model(gen_args)
    plain = PlainGPT(model)
    err = check_plain_matches(model, plain, prompts, args.new_tokens)
    rows = []
    for batch in args.batch_sizes:
        batch_prompts = [prompts[i % len(prompts)] for i in range(batch)]
        rows.append(bench_batch(model, plain, batch_prompts, args))
        print(f"batch {batch}: " + ", ".join(
            f"{name} {rows[-1][name]['decode_tokens_per_s']:.0f} tok/s" for name in
            ("transformer_fa", "transformer_fa_cuda_graph", "plain_sdpa_cat") if name in rows[-1]))
    device = torch.device(args.device)
    date = datetime.date.today().isoformat()
    data = dict(device=device_name(device), date=date, torch=torch.__version__,
                dtype=str(gen_args.dtype).replace("torch.", ""),
                model=args.checkpoint or "generate.py's toy model",
                max_logit_difference=err, rows=rows)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{data['device'].replace(' ', '-') or 'cpu'}-{date}-generate"
    path = out / f"{stem}.json"
    path.write_text(json.dumps(data, indent=1) + "\n")
    (out / f"{stem}.md").write_text(markdown(data))
    print(markdown(data))
    return path


if __name__ == "__main__":
    main()
