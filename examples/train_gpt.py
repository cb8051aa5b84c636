"""Train a small character-level GPT built from transformer_fa.TransformerLayer.

    python examples/train_gpt.py                       # about 1 minute on 2 CPU cores
    python examples/train_gpt.py --device cuda         # bf16 autocast and the fast backends
    python examples/train_gpt.py --format sbhd --normalization LayerNorm --steps 100
    torchrun --nproc-per-node 2 examples/train_gpt.py --tp 2 --sequence-parallel --format sbhd
    torchrun --nproc-per-node 2 examples/train_gpt.py --cp 2 --cp-comm-type a2a

Under torchrun the ranks form a tensor-parallel group of --tp ranks inside a context-parallel
group of --cp ranks (tp * cp = the number of processes; gloo on CPU, NCCL on CUDA); every rank
draws the same batches.

The model: token embedding -> N pre-norm TransformerLayers (causal self attention with RoPE and
GQA, SwiGLU MLP) -> final norm -> logits tied to the embedding. The corpus is
examples/data/fables.txt (original short fables written for this example).
"""
import argparse
import builtins
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

try:
    import transformer_fa  # noqa: F401
except ImportError:  # running from a checkout without installing: use the repo root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from transformer_fa import parallel
from transformer_fa.attention.rope import RotaryPositionEmbedding
from transformer_fa.module import LayerNorm, RMSNorm
from transformer_fa.transformer import TransformerLayer

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "fables.txt")

# The defaults, on every device. The corpus is small (15 KB): a larger model or more steps
# only memorizes it (seen on an H100: train loss 0.13, validation loss rising).
DEFAULTS = dict(hidden_size=128, layers=3, heads=4, gqa_groups=2, seq_len=64, batch_size=24,
                steps=300, lr=3e-3)


class CharTokenizer:
    def __init__(self, text: str):
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor([self.index[c] for c in text], dtype=torch.long)

    def decode(self, ids) -> str:
        return "".join(self.chars[i] for i in ids)


class GPT(torch.nn.Module):
    def __init__(self, vocab_size, hidden_size, layers, heads, gqa_groups, seq_len, fmt,
                 normalization, dropout, device, tp_group=None, sequence_parallel=False):
        super().__init__()
        self.fmt = fmt
        self.seq_len = seq_len
        self.embed = torch.nn.Embedding(vocab_size, hidden_size, device=device)
        torch.nn.init.normal_(self.embed.weight, std=0.02)
        self.rope = RotaryPositionEmbedding(hidden_size // heads)
        # GPT-2 style: shrink the residual-branch output projections with depth
        out_std = 0.02 / math.sqrt(2 * layers)
        self.layers = torch.nn.ModuleList(
            TransformerLayer(
                hidden_size,
                4 * hidden_size,
                heads,
                num_gqa_groups=gqa_groups,
                hidden_dropout=dropout,
                attention_dropout=0.0,
                init_method=lambda w: torch.nn.init.normal_(w, std=0.02),
                output_layer_init_method=lambda w: torch.nn.init.normal_(w, std=out_std),
                layer_number=i + 1,
                self_attn_mask_type="causal",
                normalization=normalization,
                activation="swiglu",
                bias=False,
                fuse_qkv_params=True,
                attn_input_format=fmt,
                device=device,
                set_parallel_mode=tp_group is not None,
                tp_group=tp_group,
                sequence_parallel=sequence_parallel,
            )
            for i in range(layers)
        )
        norm_cls = RMSNorm if normalization == "RMSNorm" else LayerNorm
        self.final_norm = norm_cls(hidden_size, device=device)
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.cp_size = 1

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """idx [b, s] -> logits [b, s, vocab] (this rank's part of the sequence under CP)."""
        x = self.embed(idx)
        if self.fmt == "sbhd":
            x = x.transpose(0, 1).contiguous()
        freqs = self.rope(idx.shape[1] * self.cp_size).to(x.device)
        if self.sequence_parallel:  # each TP rank runs the layers on its part of the sequence
            x = parallel.scatter_to_sequence_parallel(x, self.tp_group)
        for layer in self.layers:
            x = layer(x, rotary_pos_emb=freqs)
        if self.sequence_parallel:
            x = parallel.gather_from_sequence_parallel(x, self.tp_group)
        x = self.final_norm(x)
        if self.fmt == "sbhd":
            x = x.transpose(0, 1)
        return x @ self.embed.weight.to(x.dtype).T


def attention_backend(model: GPT) -> str:
    core = model.layers[0].self_attention.core_attention
    return getattr(core, "last_backend", None) or "unknown"


def get_batch(data, batch_size, seq_len, device, generator):
    starts = torch.randint(len(data) - seq_len - 1, (batch_size,), generator=generator)
    x = torch.stack([data[s : s + seq_len] for s in starts])
    y = torch.stack([data[s + 1 : s + seq_len + 1] for s in starts])
    return x.to(device), y.to(device)


def autocast(device):
    # bf16 autocast on CUDA (fp32 master weights); plain fp32 on CPU
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")


@torch.no_grad()
def evaluate(model, data, args, device, batches=8):
    model.eval()
    gen = torch.Generator().manual_seed(1234)
    losses = []
    for _ in range(batches):
        x, y = get_batch(data, args.batch_size, args.seq_len, device, gen)
        with autocast(device):
            logits = model(x)
        losses.append(F.cross_entropy(logits.float().flatten(0, 1), y.flatten()).item())
    model.train()
    return sum(losses) / len(losses)


@torch.no_grad()
def generate(model, tokenizer, prompt, length, device, temperature=0.8, top_k=10):
    model.eval()
    ids = tokenizer.encode(prompt).to(device)[None]
    for _ in range(length):
        with autocast(device):
            logits = model(ids[:, -model.seq_len:])[0, -1].float() / temperature
        top = torch.topk(logits, top_k)
        choice = top.indices[torch.multinomial(torch.softmax(top.values, -1), 1)]
        ids = torch.cat([ids, choice[None]], dim=1)
    return tokenizer.decode(ids[0].tolist())


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int)
    p.add_argument("--batch-size", type=int)
    p.add_argument("--seq-len", type=int)
    p.add_argument("--hidden-size", type=int)
    p.add_argument("--layers", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--gqa-groups", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--dropout", type=float, default=0.1, help="hidden dropout")
    p.add_argument("--format", choices=["bshd", "sbhd"], default="bshd")
    p.add_argument("--normalization", choices=["RMSNorm", "LayerNorm"], default="RMSNorm")
    p.add_argument("--eval-interval", type=int, default=50)
    p.add_argument("--sample-chars", type=int, default=300)
    p.add_argument("--data", default=DATA)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel ranks (run under torchrun --nproc-per-node TP)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="with --tp: split the sequence over the TP ranks between projections")
    args = p.parse_args()
    for key, value in DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def init_tensor_parallel(args, device):
    """Under torchrun: one process group of --tp ranks (NCCL on CUDA, gloo on CPU)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.tp != world:
        raise SystemExit(f"--tp {args.tp} must equal the number of processes ({world}); "
                         f"run: torchrun --nproc-per-node {args.tp} {sys.argv[0]} --tp {args.tp}")
    if world == 1:
        return device, None
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return device, dist.new_group(list(range(world)))


def clip_grad_norm(model, max_norm, tp_group):
    """clip_grad_norm_ over the whole model: the squares of the TP-split parameters are summed
    over the group, so every rank scales its gradients by the same factor."""
    if tp_group is None:
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    grads = [p for p in model.parameters() if p.grad is not None]
    split = sum((p.grad.float().square().sum() for p in grads
                 if getattr(p, "tensor_model_parallel", False)),
                torch.zeros((), device=grads[0].device))
    dist.all_reduce(split, group=tp_group)
    whole = sum(p.grad.float().square().sum() for p in grads
                if not getattr(p, "tensor_model_parallel", False))
    norm = (split + whole).sqrt()
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for p in grads:
        p.grad.mul_(scale.to(p.grad.dtype))
    return norm


def main():
    args = parse_args()
    torch.manual_seed(args.seed)
    device, tp_group = init_tensor_parallel(args, torch.device(args.device))
    rank = dist.get_rank() if tp_group is not None else 0
    # rank 0 speaks for all
    print = builtins.print if rank == 0 else (lambda *a, **k: None)  # noqa: A001
    write = tqdm.write if rank == 0 else print
    with open(args.data, encoding="utf-8") as f:
        text = f.read()
    tokenizer = CharTokenizer(text)
    data = tokenizer.encode(text)
    split = int(0.9 * len(data))
    train_data, val_data = data[:split], data[split:]

    model = GPT(len(tokenizer.chars), args.hidden_size, args.layers, args.heads, args.gqa_groups,
                args.seq_len, args.format, args.normalization, args.dropout, device, tp_group,
                args.sequence_parallel).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"corpus: {len(text)} chars, vocab {len(tokenizer.chars)}; model: {n_params / 1e6:.2f}M "
          f"params, {args.layers} layers, hidden {args.hidden_size}, {args.heads} heads / "
          f"{args.gqa_groups} kv groups, {args.format}, {args.normalization}; device {device}")

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, args.steps // 20)

    def lr_at(step):  # linear warmup, then cosine decay to 10%
        if step < warmup:
            return args.lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, args.steps - warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    gen = torch.Generator().manual_seed(args.seed)
    first_val = evaluate(model, val_data, args, device)
    print(f"step 0: val loss {first_val:.3f} (uniform guess: {math.log(len(tokenizer.chars)):.3f})")
    start = time.time()
    bar = tqdm(range(args.steps), desc="train", dynamic_ncols=True, disable=rank != 0)
    loss_ema = None
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        x, y = get_batch(train_data, args.batch_size, args.seq_len, device, gen)
        with autocast(device):
            logits = model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if args.sequence_parallel:
            parallel.allreduce_sequence_parallel_grads(model, tp_group)
        clip_grad_norm(model, 1.0, tp_group)
        opt.step()
        loss_ema = loss.item() if loss_ema is None else 0.9 * loss_ema + 0.1 * loss.item()
        bar.set_postfix(loss=f"{loss_ema:.3f}")
        if step == 0:
            write(f"attention backend: {attention_backend(model)}")
        if (step + 1) % args.eval_interval == 0 or step + 1 == args.steps:
            val = evaluate(model, val_data, args, device)
            write(f"step {step + 1}: train loss {loss_ema:.3f}, val loss {val:.3f}")
    bar.close()
    elapsed = time.time() - start
    final_val = evaluate(model, val_data, args, device)
    print(f"trained {args.steps} steps in {elapsed:.1f}s; attention backend: "
          f"{attention_backend(model)}")
    print(f"final train loss {loss_ema:.3f}, val loss {first_val:.3f} -> {final_val:.3f}")
    if args.sequence_parallel:  # a growing prompt does not split over the ranks
        print("(no sample with --sequence-parallel)")
    else:
        print("--- sample ---")
        print(generate(model, tokenizer, "THE ", args.sample_chars, device))
    if tp_group is not None:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
