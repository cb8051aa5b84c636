"""Shared by the KV cache tests (CPU and GPU): a small TransformerLayer stack run step by step
with an InferenceParams, against the same stack over each whole sequence without a cache."""
from collections import OrderedDict
from typing import Dict, List, NamedTuple

import torch

import transformer_fa as tfa

LAYERS = 2


class Config(NamedTuple):
    hidden: int = 32
    heads: int = 4
    gqa: int = 2  # K/V heads
    max_seqlen: int = 32

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


CPU = Config()
HIDDEN, HEADS, GQA, HEAD_DIM, MAX_SEQLEN = CPU.hidden, CPU.heads, CPU.gqa, CPU.head_dim, \
    CPU.max_seqlen

# Sequences joining, leaving, changing order, prefill and multi-token steps.
SCHEDULE: List[Dict[int, int]] = [
    {0: 5, 1: 3},
    {0: 1, 1: 1, 2: 4},
    {1: 2, 2: 1, 0: 1},
    {2: 1, 3: 6},
    {3: 3, 2: 1, 4: 2},
    {4: 1, 3: 1},
]


def make_stack(qkv_format: str, dtype=torch.float32, device="cpu", seed=0, cfg=CPU,
               **layer_args):
    """LAYERS TransformerLayers with distinct layer_numbers and the same weights for any
    format, dtype and device (seeded, drawn on the CPU in float32)."""
    args = dict(num_gqa_groups=cfg.gqa, hidden_dropout=0.0, attention_dropout=0.0,
                attn_input_format=qkv_format)
    args.update(layer_args)

    def stack(params_dtype, on):
        return [tfa.TransformerLayer(cfg.hidden, 2 * cfg.hidden, cfg.heads, layer_number=i + 1,
                                     params_dtype=params_dtype, device=on, **args).eval()
                for i in range(LAYERS)]

    torch.manual_seed(seed)
    drawn = stack(torch.float32, "cpu")
    if dtype == torch.float32 and device == "cpu":
        return drawn
    layers = stack(dtype, device)
    for layer, weights in zip(layers, drawn):
        layer.load_state_dict(weights.state_dict())
    return layers


def rope_table(device="cpu", cfg=CPU):
    return tfa.RotaryPositionEmbedding(cfg.head_dim).to(device)(cfg.max_seqlen)


def run_stack(stack, x, **kwargs):
    for layer in stack:
        x = layer(x, **kwargs)
    return x


def sequence_inputs(schedule, dtype=torch.float32, device="cpu", seed=1, cfg=CPU):
    """Random hidden states for every token of every sequence of the schedule."""
    totals: Dict[int, int] = {}
    for step in schedule:
        for seq, n in step.items():
            totals[seq] = totals.get(seq, 0) + n
    gen = torch.Generator().manual_seed(seed)
    return {seq: torch.randn(n, cfg.hidden, generator=gen).to(device=device, dtype=dtype)
            for seq, n in totals.items()}


def reference_outputs(stack_bshd, inputs, rope):
    """Each whole sequence alone through the stack (bshd, causal, no cache)."""
    with torch.no_grad():
        return {seq: run_stack(stack_bshd, x[None], rotary_pos_emb=rope)[0]
                for seq, x in inputs.items()}


def pack_step(tokens: List[torch.Tensor], qkv_format: str) -> torch.Tensor:
    """The step's new tokens of each sequence ([n_i, hidden]) in a format's layout."""
    if qkv_format == "thd":
        return torch.cat(tokens)
    longest = max(t.shape[0] for t in tokens)
    x = tokens[0].new_zeros(len(tokens), longest, tokens[0].shape[-1])
    for i, t in enumerate(tokens):
        x[i, :t.shape[0]] = t
    return x if qkv_format == "bshd" else x.transpose(0, 1).contiguous()


def unpack_step(out: torch.Tensor, lengths: List[int], qkv_format: str) -> List[torch.Tensor]:
    if qkv_format == "thd":
        return list(out.split(lengths))
    if qkv_format == "sbhd":
        out = out.transpose(0, 1)
    return [out[i, :n] for i, n in enumerate(lengths)]


def make_params(qkv_format, is_paged, dtype=torch.float32, device="cpu", page_size=4,
                total_num_pages=None, max_batch_size=3, cfg=CPU):
    paged = dict(is_paged=True, page_size=page_size,
                 total_num_pages=total_num_pages or max_batch_size * cfg.max_seqlen // page_size)
    return tfa.InferenceParams(max_batch_size, cfg.max_seqlen, num_heads_kv=cfg.gqa,
                               head_dim_k=cfg.head_dim, dtype=dtype, max_ctx_len=cfg.max_seqlen,
                               qkv_format=qkv_format, device=device,
                               **(paged if is_paged else {}))


def run_schedule(stack, params, inputs, qkv_format, rope, schedule=SCHEDULE):
    """Step through the schedule with the cache; yields (step, outputs per sequence, the
    token positions of those outputs)."""
    done: Dict[int, int] = {}
    for step in schedule:
        step = OrderedDict(step)
        params.pre_step(step)
        tokens = [inputs[seq][done.get(seq, 0):done.get(seq, 0) + n] for seq, n in step.items()]
        with torch.no_grad():
            out = run_stack(stack, pack_step(tokens, qkv_format), inference_params=params,
                            rotary_pos_emb=rope)
        outs = unpack_step(out, list(step.values()), qkv_format)
        positions = {}
        for seq, n in step.items():
            positions[seq] = (done.get(seq, 0), done.get(seq, 0) + n)
            done[seq] = done.get(seq, 0) + n
        yield step, dict(zip(step, outs)), positions
