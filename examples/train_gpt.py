"""Train a small character-level GPT built from transformer_fa.TransformerLayer.

    python examples/train_gpt.py                       # about 1 minute on 2 CPU cores
    python examples/train_gpt.py --device cuda         # bf16 autocast and the fast backends
    python examples/train_gpt.py --device cuda --fp8 delayed   # FP8 GEMMs (or --fp8 current)
    python examples/train_gpt.py --format sbhd --normalization LayerNorm --steps 100
    torchrun --nproc-per-node 2 examples/train_gpt.py --tp 2 --sequence-parallel --format sbhd
    torchrun --nproc-per-node 2 examples/train_gpt.py --cp 2 --cp-comm-type a2a

Under torchrun the processes form --cp context-parallel groups of --tp tensor-parallel ranks
(tp * cp = the number of processes; gloo on CPU, NCCL on CUDA; rank = cp_rank * tp + tp_rank).
Every rank draws the same batches; under CP each rank keeps its load-balanced part of every
sequence (TE's convention: the sequence cut into 2 * cp chunks, rank r keeps chunks r and
2 * cp - 1 - r), the loss is the mean over the whole sequence and the gradients are averaged over
the CP group. The text sample is generated without CP (every rank holds the whole model).

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

import transformer_fa
from transformer_fa import parallel
from transformer_fa.common.recipe import DelayedScaling, Float8CurrentScaling
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
                 normalization, dropout, device, tp_group=None, sequence_parallel=False,
                 cp_group=None, cp_comm_type="p2p"):
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
        self.cp_comm_type = cp_comm_type
        self.set_context_parallel_group(cp_group)

    def set_context_parallel_group(self, cp_group):
        """Attend over ``cp_group`` (None: each rank holds whole sequences)."""
        ranks = None if cp_group is None else dist.get_process_group_ranks(cp_group)
        for layer in self.layers:
            layer.set_context_parallel_group(cp_group, ranks, None, self.cp_comm_type)
        self.cp_group = cp_group
        self.cp_size = 1 if cp_group is None else dist.get_world_size(cp_group)

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


def cp_part(t: torch.Tensor, cp_group) -> torch.Tensor:
    """This CP rank's load-balanced part of ``t`` [b, s]: chunks r and 2c-1-r of 2c."""
    if cp_group is None:
        return t
    size, rank = dist.get_world_size(cp_group), dist.get_rank(cp_group)
    chunks = t.chunk(2 * size, dim=1)
    return torch.cat([chunks[rank], chunks[2 * size - 1 - rank]], dim=1)


def loss_on_batch(model, x, y):
    """Cross entropy of this rank's part of the batch: a mean over its tokens (under CP every
    rank holds as many tokens, so the mean of these means is the whole batch's loss)."""
    x, y = cp_part(x, model.cp_group), cp_part(y, model.cp_group)
    recipe = getattr(model, "fp8_recipe", None)
    with autocast(x.device), transformer_fa.autocast(enabled=recipe is not None, recipe=recipe):
        logits = model(x)
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def cp_mean(value: torch.Tensor, cp_group) -> float:
    """The mean of ``value`` over the CP group (the value itself without CP)."""
    if cp_group is not None:
        value = value.detach().clone()
        dist.all_reduce(value, group=cp_group)
        value /= dist.get_world_size(cp_group)
    return value.item()


def average_grads(model, cp_group) -> None:
    """Each CP rank's gradients come from its own tokens' losses: their mean over the group
    is the gradient of the whole batch's loss (one all-reduce of all gradients)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=cp_group)
    flat /= dist.get_world_size(cp_group)
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))


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
        losses.append(cp_mean(loss_on_batch(model, x, y), model.cp_group))
    model.train()
    return sum(losses) / len(losses)


@torch.no_grad()
def generate(model, tokenizer, prompt, length, device, temperature=0.8, top_k=10):
    """Sampling with the whole (growing) prompt on every CP rank: CP is off meanwhile."""
    cp_group = model.cp_group
    model.set_context_parallel_group(None)
    try:
        return _generate(model, tokenizer, prompt, length, device, temperature, top_k)
    finally:
        model.set_context_parallel_group(cp_group)


def _generate(model, tokenizer, prompt, length, device, temperature, top_k):
    model.eval()
    ids = tokenizer.encode(prompt).to(device)[None]
    for _ in range(length):
        with autocast(device):
            logits = model(ids[:, -model.seq_len:])[0, -1].float() / temperature
        top = torch.topk(logits, top_k)
        choice = top.indices[torch.multinomial(torch.softmax(top.values, -1), 1)]
        ids = torch.cat([ids, choice[None]], dim=1)
    return tokenizer.decode(ids[0].tolist())


def save_checkpoint(path, model, tokenizer, args):
    """The weights, the arguments of GPT() that rebuild the model (on any device, without
    parallelism) and the vocab."""
    config = dict(vocab_size=len(tokenizer.chars), hidden_size=args.hidden_size,
                  layers=args.layers, heads=args.heads, gqa_groups=args.gqa_groups,
                  seq_len=args.seq_len, fmt=args.format, normalization=args.normalization)
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    torch.save(dict(model=state, config=config, chars=tokenizer.chars), path)


def load_checkpoint(path, device):
    """The model (eval mode, no dropout) and the tokenizer saved by save_checkpoint."""
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    tokenizer = CharTokenizer("")
    tokenizer.chars = list(checkpoint["chars"])
    tokenizer.index = {c: i for i, c in enumerate(tokenizer.chars)}
    model = GPT(**checkpoint["config"], dropout=0.0, device=device)
    model.load_state_dict(checkpoint["model"])
    return model.eval(), tokenizer


def parse_args(argv=None):
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
    p.add_argument("--save", metavar="PATH",
                   help="save a checkpoint at the end (the model's weights, its config and "
                        "the vocab) for examples/generate.py --checkpoint")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel ranks (run under torchrun --nproc-per-node TP*CP)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="with --tp: split the sequence over the TP ranks between projections")
    p.add_argument("--cp", type=int, default=1,
                   help="context-parallel ranks (run under torchrun --nproc-per-node TP*CP)")
    p.add_argument("--cp-comm-type", choices=["p2p", "all_gather", "a2a"], default="p2p",
                   help="with --cp: how attention reaches the other ranks' keys and values")
    p.add_argument("--fp8", choices=["delayed", "current"],
                   help="the layers' GEMMs in FP8 with TE's DelayedScaling or "
                        "Float8CurrentScaling recipe (needs a GPU of compute capability 8.9+)")
    args = p.parse_args(argv)
    for key, value in DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.tp < 1 or args.cp < 1:
        p.error(f"--tp and --cp must be positive, got {args.tp} and {args.cp}")
    if args.save and args.tp > 1:
        p.error("--save needs --tp 1 (each TP rank holds only part of the weights)")
    if args.seq_len % (2 * args.cp):
        p.error(f"--seq-len {args.seq_len} must be divisible by 2 * --cp = {2 * args.cp} "
                f"(each CP rank holds 2 chunks of every sequence)")
    return args


def init_parallel(args, device):
    """Under torchrun: --cp groups of --tp consecutive ranks (NCCL on CUDA, gloo on CPU).
    Returns (device, tp_group, cp_group); a group is None where its size is 1. A process group
    that the caller already started (main called from Python) is used as it is."""
    if dist.is_initialized() and args.tp * args.cp == 1:
        return device, None, None  # the caller's processes each train a whole model
    world = dist.get_world_size() if dist.is_initialized() else int(
        os.environ.get("WORLD_SIZE", "1"))
    if args.tp * args.cp != world:
        raise SystemExit(f"--tp {args.tp} * --cp {args.cp} must equal the number of processes "
                         f"({world}); run: torchrun --nproc-per-node {args.tp * args.cp} "
                         f"{sys.argv[0]} --tp {args.tp} --cp {args.cp}")
    if world == 1:
        return device, None, None
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, tp_group, cp_group = dist.get_rank(), None, None
    # every rank creates every group, in the same order
    for c in range(args.cp if args.tp > 1 else 0):
        group = dist.new_group([c * args.tp + t for t in range(args.tp)])
        tp_group = group if rank // args.tp == c else tp_group
    for t in range(args.tp if args.cp > 1 else 0):
        group = dist.new_group([c * args.tp + t for c in range(args.cp)])
        cp_group = group if rank % args.tp == t else cp_group
    return device, tp_group, cp_group


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


def main(argv=None):
    """Trains; returns each step's train loss and gradient norm (before clipping) and each
    evaluation's val loss, the same on every rank."""
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    started = dist.is_initialized()
    device, tp_group, cp_group = init_parallel(args, torch.device(args.device))
    rank = dist.get_rank() if dist.is_initialized() else 0
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
                args.sequence_parallel, cp_group, args.cp_comm_type).to(device)
    model.fp8_recipe = {None: None, "delayed": DelayedScaling(),
                        "current": Float8CurrentScaling()}[args.fp8]
    n_params = sum(p.numel() for p in model.parameters())
    print(f"corpus: {len(text)} chars, vocab {len(tokenizer.chars)}; model: {n_params / 1e6:.2f}M "
          f"params, {args.layers} layers, hidden {args.hidden_size}, {args.heads} heads / "
          f"{args.gqa_groups} kv groups, {args.format}, {args.normalization}; device {device}")
    if args.tp * args.cp > 1:
        print(f"tp {args.tp}{' with sequence parallelism' * args.sequence_parallel}, cp "
              f"{args.cp}{f' ({args.cp_comm_type})' * (args.cp > 1)}")

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, args.steps // 20)

    def lr_at(step):  # linear warmup, then cosine decay to 10%
        if step < warmup:
            return args.lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, args.steps - warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    gen = torch.Generator().manual_seed(args.seed)
    first_val = evaluate(model, val_data, args, device)
    losses = dict(train=[], grad_norm=[], val=[first_val])
    print(f"step 0: val loss {first_val:.3f} (uniform guess: {math.log(len(tokenizer.chars)):.3f})")
    start = time.time()
    bar = tqdm(range(args.steps), desc="train", dynamic_ncols=True, disable=rank != 0)
    loss_ema = None
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        x, y = get_batch(train_data, args.batch_size, args.seq_len, device, gen)
        loss = loss_on_batch(model, x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if args.sequence_parallel:
            parallel.allreduce_sequence_parallel_grads(model, tp_group)
        if cp_group is not None:
            average_grads(model, cp_group)
        losses["grad_norm"].append(clip_grad_norm(model, 1.0, tp_group))  # read at the end
        opt.step()
        losses["train"].append(cp_mean(loss, cp_group))
        loss_ema = losses["train"][-1] if loss_ema is None else (
            0.9 * loss_ema + 0.1 * losses["train"][-1])
        bar.set_postfix(loss=f"{loss_ema:.3f}")
        if step == 0:
            write(f"attention backend: {attention_backend(model)}")
        if (step + 1) % args.eval_interval == 0 or step + 1 == args.steps:
            losses["val"].append(evaluate(model, val_data, args, device))
            write(f"step {step + 1}: train loss {loss_ema:.3f}, val loss {losses['val'][-1]:.3f}")
    bar.close()
    elapsed = time.time() - start
    final_val = evaluate(model, val_data, args, device)
    print(f"trained {args.steps} steps in {elapsed:.1f}s; attention backend: "
          f"{attention_backend(model)}")
    print(f"final train loss {loss_ema:.3f}, val loss {first_val:.3f} -> {final_val:.3f}")
    if args.sequence_parallel:  # a growing prompt does not split over the TP ranks
        print("(no sample with --sequence-parallel)")
    else:
        print("--- sample ---")
        print(generate(model, tokenizer, "THE ", args.sample_chars, device))
    if args.save and rank == 0:
        save_checkpoint(args.save, model, tokenizer, args)
        print(f"checkpoint saved to {args.save}")
    if dist.is_initialized() and not started:
        dist.destroy_process_group()
    losses["grad_norm"] = [float(norm) for norm in losses["grad_norm"]]
    return losses


if __name__ == "__main__":
    main()
