"""Text generation with the KV cache (transformer_fa.InferenceParams).

A small GPT built from TransformerLayer (RoPE, GQA) learns to continue "counting" sequences
(each token is the previous + 1, modulo the vocabulary) in a few training steps, then
generates greedily for a batch of prompts of different lengths: one prefill step, then one
token per step, each layer appending its new K/V to the cache in place. The cached output is
checked against recomputing the whole prefix without a cache.

    python examples/generate.py               # CPU, a few seconds
    python examples/generate.py --paged --qkv-format thd --device cuda
"""
import argparse
import time
from collections import OrderedDict

import torch

import transformer_fa as te


class TinyGPT(torch.nn.Module):
    def __init__(self, vocab, hidden, heads, gqa, layers, max_seqlen, qkv_format, device):
        super().__init__()
        self.qkv_format = qkv_format
        self.embed = torch.nn.Embedding(vocab, hidden, device=device)
        self.layers = torch.nn.ModuleList(
            te.TransformerLayer(hidden, 4 * hidden, heads, num_gqa_groups=gqa,
                                hidden_dropout=0.0, attention_dropout=0.0, layer_number=i + 1,
                                attn_input_format=qkv_format, device=device)
            for i in range(layers))
        self.head = torch.nn.Linear(hidden, vocab, device=device)
        self.rope = te.RotaryPositionEmbedding(hidden // heads).to(device)(max_seqlen)

    def forward(self, tokens, **kwargs):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, rotary_pos_emb=self.rope, **kwargs)
        return self.head(x)


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


def generate(model, prompts, new_tokens, params):
    """Greedy decoding with the cache: returns the sequences and their step logits."""
    seqs = {i: list(p) for i, p in enumerate(prompts)}
    step = OrderedDict((i, len(p)) for i, p in seqs.items())
    logits_per_step = []
    device = model.head.weight.device
    for _ in range(new_tokens):
        params.pre_step(step)
        rows = [seqs[i][-n:] for i, n in step.items()]
        with torch.no_grad():
            logits = model(pack(rows, model.qkv_format, device), inference_params=params)
        last = last_logits(logits, list(step.values()), model.qkv_format)
        logits_per_step.append(last)
        for i, token in zip(step, last.argmax(-1).tolist()):
            seqs[i].append(token)
        step = OrderedDict((i, 1) for i in seqs)
    return seqs, logits_per_step


def generate_without_cache(model, prompts, new_tokens):
    """The same, recomputing each whole prefix (one sequence at a time, no cache)."""
    seqs = [list(p) for p in prompts]
    logits_per_step = []
    for _ in range(new_tokens):
        step_logits = []
        for seq in seqs:
            with torch.no_grad():
                x = torch.tensor([seq], device=model.head.weight.device)
                step_logits.append(model.head(run_full(model, x))[0, -1])
            seq.append(int(step_logits[-1].argmax()))
        logits_per_step.append(torch.stack(step_logits))
    return dict(enumerate(seqs)), logits_per_step


def run_full(model, tokens):
    """Hidden states [b, s, h] of whole sequences [b, s] (no cache), in the layers' format."""
    x = model.embed(tokens)
    b, s = tokens.shape
    fmt = model.qkv_format
    x = x.transpose(0, 1) if fmt == "sbhd" else (x.flatten(0, 1) if fmt == "thd" else x)
    kwargs = {}
    if fmt == "thd":
        cu = torch.arange(0, b * s + 1, s, dtype=torch.int32, device=x.device)
        kwargs = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu)
    for layer in model.layers:
        x = layer(x, rotary_pos_emb=model.rope, **kwargs)
    return x.transpose(0, 1) if fmt == "sbhd" else (x.view(b, s, -1) if fmt == "thd" else x)


def train(model, vocab, steps, seqlen=24, batch=16):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    device = model.head.weight.device
    for _ in range(steps):
        start = torch.randint(0, vocab, (batch, 1), device=device)
        tokens = (start + torch.arange(seqlen + 1, device=device)) % vocab
        logits = model.head(run_full(model, tokens[:, :-1]))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return loss.item()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--qkv-format", default="bshd", choices=["bshd", "sbhd", "thd"])
    parser.add_argument("--paged", action="store_true")
    parser.add_argument("--train-steps", type=int, default=40)
    parser.add_argument("--new-tokens", type=int, default=12)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    vocab, max_seqlen = 32, 64
    model = TinyGPT(vocab, hidden=64, heads=4, gqa=2, layers=2, max_seqlen=max_seqlen,
                    qkv_format=args.qkv_format, device=args.device)
    loss = train(model, vocab, args.train_steps)
    print(f"trained {args.train_steps} steps, loss {loss:.3f}")
    model.eval()

    prompts = [[3, 4, 5, 6, 7], [20, 21], [30, 31, 0]]
    paged = dict(is_paged=True, page_size=16, total_num_pages=len(prompts) * max_seqlen // 16)
    params = te.InferenceParams(len(prompts), max_seqlen, num_heads_kv=2, head_dim_k=16,
                                dtype=torch.float32, max_ctx_len=max_seqlen,
                                qkv_format=args.qkv_format, device=args.device,
                                **(paged if args.paged else {}))
    start = time.perf_counter()
    seqs, logits = generate(model, prompts, args.new_tokens, params)
    elapsed = time.perf_counter() - start
    for i, seq in seqs.items():
        print(f"prompt {prompts[i]} -> {seq[len(prompts[i]):]}")
    print(f"{len(prompts) * args.new_tokens / elapsed:.0f} tokens/s with the KV cache "
          f"({args.qkv_format}, {'paged' if args.paged else 'contiguous'}, {args.device})")

    plain_seqs, plain_logits = generate_without_cache(model, prompts, args.new_tokens)
    assert seqs == plain_seqs, "the KV cache changed the generated tokens"
    err = max((a - b).abs().max().item() for a, b in zip(logits, plain_logits))
    print(f"same tokens as recomputing every prefix without a cache; max logit difference "
          f"{err:.2e}")
    return seqs, err


if __name__ == "__main__":
    main()
