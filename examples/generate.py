"""Text generation with the KV cache (transformer_fa.InferenceParams).

Either a character-level GPT saved by ``examples/train_gpt.py --save PATH`` (``--checkpoint
PATH``, prompts given with ``--prompt``), or, without a checkpoint, a small GPT built from
TransformerLayer (RoPE, GQA) that learns to continue "counting" sequences (each token is the
previous + 1, modulo the vocabulary) in a few training steps. A batch of prompts of different
lengths runs one prefill step, then one token per step, each layer appending its new K/V to
the cache in place. Greedy by default (``--temperature 0``); ``--temperature T --top-k K
--seed S`` sample. Every step's cached logits are checked against recomputing the generated
sequences without a cache (the same tokens, so sampling is checked with its own draws).

    python examples/generate.py               # CPU, a few seconds
    python examples/generate.py --paged --qkv-format thd --device cuda
    python examples/train_gpt.py --save gpt.pt && \\
        python examples/generate.py --checkpoint gpt.pt --prompt "THE " --temperature 0.8 --top-k 10
    python examples/generate.py --checkpoint gpt.pt --device cuda --cuda-graph
"""
import argparse
import os
import sys
import time
from collections import OrderedDict

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
try:
    import transformer_fa  # noqa: F401
except ImportError:  # running from a checkout without installing: use the repo root
    sys.path.insert(0, os.path.dirname(HERE))

import transformer_fa as te  # noqa: E402
from transformer_fa.attention.inference import NonPagedKVCacheManager  # noqa: E402

try:
    from tqdm import tqdm
except ImportError:
    tqdm = None

TOY_PROMPTS = [[3, 4, 5, 6, 7], [20, 21], [30, 31, 0]]
# The largest allowed difference between cached and recomputed logits, relative to the
# largest recomputed logit (at least 1).
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}


class TinyGPT(torch.nn.Module):
    def __init__(self, vocab, hidden, heads, gqa, layers, max_seqlen, qkv_format, device):
        super().__init__()
        self.qkv_format = qkv_format
        self.kv_heads, self.head_dim = gqa, hidden // heads
        self.embed = torch.nn.Embedding(vocab, hidden, device=device)
        self.layers = torch.nn.ModuleList(
            te.TransformerLayer(hidden, 4 * hidden, heads, num_gqa_groups=gqa,
                                hidden_dropout=0.0, attention_dropout=0.0, layer_number=i + 1,
                                attn_input_format=qkv_format, device=device)
            for i in range(layers))
        self.head = torch.nn.Linear(hidden, vocab, device=device)
        # Not a buffer: model.to(bfloat16) must not cast the angles (bf16 has 8 bits of
        # mantissa: position 500's angles would be off by radians). TE's tables are float32.
        self.rope = te.RotaryPositionEmbedding(hidden // heads)(max_seqlen).to(device)

    def forward(self, tokens, **kwargs):
        """tokens in the layers' format -> logits; kwargs go to every layer."""
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, rotary_pos_emb=self.rope, **kwargs)
        return self.head(x)


class CheckpointGPT(torch.nn.Module):
    """train_gpt.py's GPT with TinyGPT's interface (its own forward takes no layer kwargs)."""

    def __init__(self, gpt, max_seqlen):
        super().__init__()
        self.gpt = gpt
        self.qkv_format = gpt.fmt
        attention = gpt.layers[0].self_attention
        self.kv_heads, self.head_dim = attention.num_gqa_groups, attention.hidden_size_per_attention_head
        self.rope = gpt.rope(max_seqlen).float().to(gpt.embed.weight.device)  # as TinyGPT's

    def forward(self, tokens, **kwargs):
        gpt = self.gpt
        x = gpt.embed(tokens)
        for layer in gpt.layers:
            x = layer(x, rotary_pos_emb=self.rope, **kwargs)
        return gpt.final_norm(x) @ gpt.embed.weight.T


def model_device(model):
    return next(model.parameters()).device


def pack(rows, qkv_format, device):
    """New tokens of each sequence (lists) as the model's input in its format."""
    if qkv_format == "thd":
        return torch.tensor([t for row in rows for t in row], device=device)
    batch = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long, device=device)
    for i, row in enumerate(rows):
        batch[i, :len(row)] = torch.tensor(row)
    return batch if qkv_format == "bshd" else batch.t()


def last_logits(logits, lengths, qkv_format):
    """The logits of each sequence's last new token."""
    if qkv_format == "thd":
        ends = torch.tensor(lengths).cumsum(0) - 1
        return logits[ends]
    if qkv_format == "sbhd":
        logits = logits.transpose(0, 1)
    return logits[torch.arange(len(lengths)), torch.tensor(lengths) - 1]


def one_token_input(tokens, qkv_format):
    """One new token per sequence (``[b]``) as the model's input in its format."""
    return {"bshd": tokens[:, None], "sbhd": tokens[None], "thd": tokens}[qkv_format]


def run_full(model, tokens):
    """Logits ``[b, s, vocab]`` of whole sequences ``[b, s]`` (no cache)."""
    b, s = tokens.shape
    fmt = model.qkv_format
    kwargs = {}
    if fmt == "thd":
        cu = torch.arange(0, b * s + 1, s, dtype=torch.int32, device=tokens.device)
        kwargs = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu)
    inputs = {"bshd": tokens, "sbhd": tokens.t(), "thd": tokens.flatten()}[fmt]
    logits = model(inputs, **kwargs)
    return logits.transpose(0, 1) if fmt == "sbhd" else logits.view(b, s, -1)


def check_sampling(temperature, top_k):
    if not isinstance(temperature, (int, float)) or temperature < 0:
        raise ValueError(f"temperature must be a number >= 0 (0: greedy), got {temperature!r}")
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 0:
        raise ValueError(f"top_k must be an int >= 0 (0: all tokens), got {top_k!r}")


def sample(logits, temperature=0.0, top_k=0, generator=None):
    """One token per row of ``logits [b, vocab]``: the argmax for temperature 0, else a draw
    from softmax(logits / temperature) over the top_k largest logits (all for top_k 0)."""
    check_sampling(temperature, top_k)
    if temperature == 0:
        return logits.argmax(-1)
    scaled = logits.float() / temperature
    index = None
    if top_k:
        scaled, index = scaled.topk(min(top_k, scaled.shape[-1]), dim=-1)
    choice = torch.multinomial(torch.softmax(scaled, -1), 1, generator=generator)
    return (choice if index is None else index.gather(-1, choice))[:, 0]


class StaticPlanCache(NonPagedKVCacheManager):
    """The non-paged cache with the per-token write plan of pre_step (cache row, batch index,
    step position) copied into tensors that keep their addresses from step to step, so that
    a captured decode step reads each step's plan."""

    PLAN = ("_write_rows", "_token_seq", "_token_pos")

    def pre_step(self, step_dict):
        sequences = super().pre_step(step_dict)
        if not hasattr(self, "_static_plan"):
            self._static_plan = {}
        for name in self.PLAN:
            planned, static = getattr(self, name), self._static_plan.get(name)
            if static is None or static.shape != planned.shape:
                self._static_plan[name] = static = planned.clone()
            setattr(self, name, static.copy_(planned))
        return sequences


class GraphedDecodeStep:
    """The one-token decode step (the model forward that follows params.pre_step) in a CUDA
    graph: the first call runs eagerly on a side stream (warm-up), the second captures the
    step and replays it, later calls replay it. The new tokens go through a static input
    buffer; the logits come back from a static output buffer (cloned)."""

    def __init__(self, step):
        self.step, self.graph, self.tokens, self.logits = step, None, None, None

    def __call__(self, tokens):
        if self.tokens is None:
            self.tokens = tokens.clone()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                logits = self.step(self.tokens)
            torch.cuda.current_stream().wait_stream(side)
            return logits
        self.tokens.copy_(tokens)
        if self.graph is None:
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph):
                    self.logits = self.step(self.tokens)
            except RuntimeError as err:
                raise RuntimeError(
                    f"--cuda-graph: the decode step could not be captured in a CUDA graph (a "
                    f"host sync or host-dependent work inside the model forward): {err}") from err
            self.graph = graph
        self.graph.replay()
        return self.logits.clone()


class Progress:
    """tqdm when it is installed, else a line every tenth of the way."""

    def __init__(self, total, enabled=True):
        self.total, self.done, self.enabled = total, 0, enabled
        self.bar = tqdm(total=total, desc="generate", unit="tok/seq") if (
            enabled and tqdm is not None) else None

    def update(self):
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)
        elif self.enabled and (self.done == self.total or self.done % max(1, self.total // 10) == 0):
            print(f"generate: {self.done}/{self.total} tokens per sequence", flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def make_params(model, batch, max_seqlen, dtype, paged=False, cuda_graph=False):
    device = model_device(model)
    paged_args = dict(is_paged=True, page_size=16,
                      total_num_pages=batch * -(-max_seqlen // 16)) if paged else {}
    max_seqlen = -(-max_seqlen // 16) * 16 if paged else max_seqlen
    return te.InferenceParams(batch, max_seqlen, num_heads_kv=model.kv_heads,
                              head_dim_k=model.head_dim, dtype=dtype, max_ctx_len=max_seqlen,
                              qkv_format=model.qkv_format, device=device,
                              custom_cache_manager=StaticPlanCache if cuda_graph else None,
                              **paged_args)


def generate(model, prompts, new_tokens, params, temperature=0.0, top_k=0, generator=None,
             cuda_graph=False, progress=True):
    """Prefill, then one token per step with the cache. Returns the sequences (prompt and new
    tokens, by prompt index), the logits ``[b, vocab]`` of every step and the timing: the
    prefill's seconds, the decode loop's seconds and its number of tokens (all sequences)."""
    check_sampling(temperature, top_k)
    if new_tokens < 1:
        raise ValueError(f"new_tokens must be >= 1, got {new_tokens}")
    device, fmt, batch = model_device(model), model.qkv_format, len(prompts)
    if cuda_graph and device.type != "cuda":
        raise ValueError(f"cuda_graph needs the model on a CUDA device, got {device}")
    if cuda_graph and not isinstance(params.cache_manager, StaticPlanCache):
        raise ValueError("cuda_graph needs the params of make_params(..., cuda_graph=True)")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def decode_step(tokens):
        return model(one_token_input(tokens, fmt), inference_params=params).reshape(batch, -1)

    step = GraphedDecodeStep(decode_step) if cuda_graph else decode_step
    bar = Progress(new_tokens, progress)
    lengths = [len(p) for p in prompts]
    with torch.no_grad():
        sync()
        start = time.perf_counter()
        params.pre_step(OrderedDict(enumerate(lengths)))
        logits = last_logits(model(pack(prompts, fmt, device), inference_params=params),
                             lengths, fmt)
        tokens = sample(logits, temperature, top_k, generator)
        sync()
        prefill_s = time.perf_counter() - start
        bar.update()
        all_logits, all_tokens = [logits], [tokens]
        one_each = OrderedDict((i, 1) for i in range(batch))
        start = time.perf_counter()
        for _ in range(new_tokens - 1):
            params.pre_step(one_each)  # on the host: where each new K/V token goes
            logits = step(tokens)
            tokens = sample(logits, temperature, top_k, generator)
            all_logits.append(logits)
            all_tokens.append(tokens)
            bar.update()
        sync()
        decode_s = time.perf_counter() - start
    bar.close()
    new = torch.stack(all_tokens, 1).tolist()
    seqs = {i: list(p) + new[i] for i, p in enumerate(prompts)}
    return seqs, all_logits, dict(prefill_s=prefill_s, decode_s=decode_s,
                                  decode_tokens=batch * (new_tokens - 1))


def check_against_recomputation(model, prompts, seqs, logits_per_step, greedy):
    """Recompute each generated sequence without a cache (one at a time, causal: one call
    gives every step's logits) and compare with the cached logits of every step; with greedy
    decoding each token must also be the recomputed argmax (unless the top two recomputed
    logits are closer than the tolerance). Returns the largest logit difference."""
    device = model_device(model)
    worst = 0.0
    with torch.no_grad():
        for i, prompt in enumerate(prompts):
            full = run_full(model, torch.tensor([seqs[i][:-1]], device=device))[0].float()
            for step, cached in enumerate(logits_per_step):
                ref = full[len(prompt) - 1 + step]
                err = (cached[i].float() - ref).abs().max().item()
                allowed = TOLERANCE[cached.dtype] * max(1.0, ref.abs().max().item())
                if err > allowed:
                    raise AssertionError(f"sequence {i}, step {step}: cached logits differ from "
                                         f"recomputed ones by {err:.3g} (allowed {allowed:.3g})")
                token = seqs[i][len(prompt) + step]
                top2 = ref.topk(2).values
                if greedy and token != int(ref.argmax()) and top2[0] - top2[1] > allowed:
                    raise AssertionError(f"sequence {i}, step {step}: the cache changed the "
                                         f"greedy token ({token} != {int(ref.argmax())})")
                worst = max(worst, err)
    return worst


def train_toy(model, vocab, steps, seqlen=24, batch=16):
    """Train the toy model to count; returns the last loss."""
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    device = model_device(model)
    loss = torch.zeros(())
    for _ in range(steps):
        start = torch.randint(0, vocab, (batch, 1), device=device)
        tokens = (start + torch.arange(seqlen + 1, device=device)) % vocab
        logits = run_full(model, tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return loss.item()


def load_train_gpt():
    """examples/train_gpt.py as a module (its GPT, CharTokenizer and load_checkpoint)."""
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    import train_gpt
    return train_gpt


def build_model(args):
    """The model (eval mode, args.dtype), the prompts as token lists and a decoder of token
    lists (None for the toy model)."""
    device = torch.device(args.device)
    if args.checkpoint is None:
        if args.prompt:
            raise ValueError("--prompt needs --checkpoint (the toy model's prompts are fixed)")
        torch.manual_seed(0)
        max_seqlen = max(64, max(map(len, TOY_PROMPTS)) + args.new_tokens)  # RoPE's table
        model = TinyGPT(32, hidden=64, heads=4, gqa=2, layers=2, max_seqlen=max_seqlen,
                        qkv_format=args.qkv_format or "bshd", device=device)
        loss = train_toy(model, 32, args.train_steps)
        print(f"trained the toy model {args.train_steps} steps, loss {loss:.3f}")
        return model.eval().to(args.dtype), [list(p) for p in TOY_PROMPTS], None
    gpt, tokenizer = load_train_gpt().load_checkpoint(args.checkpoint, device)
    if args.qkv_format not in (None, gpt.fmt):
        raise ValueError(f"--qkv-format {args.qkv_format}: the checkpoint's model was built "
                         f"for {gpt.fmt}")
    texts = args.prompt or ["THE "]
    prompts = []
    for text in texts:
        unknown = sorted(set(text) - set(tokenizer.chars))
        if not text or unknown:
            raise ValueError(f"--prompt {text!r} must be non-empty text in the checkpoint's "
                             f"vocab (unknown characters: {unknown})")
        prompts.append(tokenizer.encode(text).tolist())
    max_seqlen = max(map(len, prompts)) + args.new_tokens
    return CheckpointGPT(gpt, max_seqlen).to(args.dtype), prompts, tokenizer.decode


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", help="a model saved by examples/train_gpt.py --save")
    p.add_argument("--prompt", action="append", help="a prompt (repeatable; with --checkpoint)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                   help="the model's and the cache's dtype (default: bfloat16 on CUDA, "
                        "float32 on the CPU)")
    p.add_argument("--qkv-format", choices=["bshd", "sbhd", "thd"],
                   help="the layers' format (default bshd; a checkpoint's own format)")
    p.add_argument("--paged", action="store_true")
    p.add_argument("--train-steps", type=int, default=40, help="the toy model's training")
    p.add_argument("--new-tokens", type=int, default=12)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest (0: all)")
    p.add_argument("--seed", type=int, default=0, help="the sampling generator's seed")
    p.add_argument("--cuda-graph", action="store_true",
                   help="capture the one-token decode step in a CUDA graph (CUDA only)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.temperature < 0 or args.top_k < 0:
        p.error(f"--temperature and --top-k must be >= 0, got {args.temperature} and "
                f"{args.top_k}")
    if args.new_tokens < 1:
        p.error(f"--new-tokens must be >= 1, got {args.new_tokens}")
    if args.cuda_graph and torch.device(args.device).type != "cuda":
        p.error(f"--cuda-graph needs --device cuda (CUDA graphs), got --device {args.device}")
    if args.cuda_graph and args.paged:
        p.error("--cuda-graph needs a non-paged cache: the paged attention call's page table "
                "grows with the sequences (a new shape every page)")
    args.dtype = getattr(torch, args.dtype or (
        "bfloat16" if torch.device(args.device).type == "cuda" else "float32"))
    return args


def main(argv=None):
    """Generates and checks; returns the sequences and the largest logit difference from
    recomputation."""
    args = parse_args(argv)
    model, prompts, decode = build_model(args)
    max_seqlen = max(map(len, prompts)) + args.new_tokens
    params = make_params(model, len(prompts), max_seqlen, args.dtype, args.paged,
                         args.cuda_graph)
    generator = torch.Generator(model_device(model)).manual_seed(args.seed)
    seqs, logits, timing = generate(model, prompts, args.new_tokens, params, args.temperature,
                                    args.top_k, generator, args.cuda_graph,
                                    progress=not args.no_progress)
    for i, seq in seqs.items():
        if decode is None:
            print(f"prompt {prompts[i]} -> {seq[len(prompts[i]):]}")
        else:
            print(f"--- {decode(prompts[i])!r} ->\n{decode(seq)}")
    rate = timing["decode_tokens"] / timing["decode_s"] if timing["decode_tokens"] else 0.0
    mode = "greedy" if args.temperature == 0 else (
        f"temperature {args.temperature}, top-k {args.top_k or 'off'}")
    print(f"prefill {timing['prefill_s'] * 1e3:.1f} ms; decode {rate:.0f} tokens/s "
          f"({timing['decode_tokens']} tokens, batch {len(prompts)}; {mode}; "
          f"{model.qkv_format}, {'paged' if args.paged else 'contiguous'}, {args.dtype}, "
          f"{args.device}{', CUDA graph' if args.cuda_graph else ''})")
    err = check_against_recomputation(model, prompts, seqs, logits, args.temperature == 0)
    print(f"every step's cached logits match recomputing the sequences without a cache: max "
          f"difference {err:.2e}")
    return seqs, err


if __name__ == "__main__":
    main()
