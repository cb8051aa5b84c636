"""Context, tensor and data parallelism on 2 GPUs over NCCL (skipped without 2 GPUs and NCCL).

One spawn of 2 processes (rank r on GPU r, NVLink multicast off) runs every case
(tests/distributed_utils.py); a failing case reports each rank's traceback. The cases are the
CPU modules' (tests/test_context_parallel.py, tests/test_tensor_parallel.py) run on CUDA:

- CP (p2p, all_gather, a2a; causal and no_mask; bshd and sbhd; thd with p2p and all_gather;
  GQA 8 / 4 heads, d = 64 and 128) in bf16: each rank's output and q/k/v gradients against its
  load-balanced part of one GPU's float64 run on the full tensors. CP goes through the backend
  selection block by block: each case runs with only FlashAttention or only
  FusedAttention allowed by the NVTE_* switches and checks that the bshd/sbhd blocks ran on
  that backend's kernels (thd blocks: the PyTorch math). Beside them, one GPU's bf16 attention on
  the same full tensors with each backend forced runs that backend and meets the same
  tolerance against the float64 run.
- TP and TP + sequence parallelism: a stack of 2 TransformerLayers in float32, output and
  gradients against the slices of the same model on one GPU.
- DDP and FSDP2: 3 SGD steps in float32, the losses equal one GPU's on the whole batch.
"""
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist

from distributed_utils import assert_case_passed, run_cases, scoped_env
from test_context_parallel import (attention_case, close_outputs, draw_attention_inputs,
                                   run_attention, thd_case)
from test_tensor_parallel import build, compare, data_parallel_case, ddp, fsdp2

import transformer_fa as te
from transformer_fa.attention import context_parallel
from transformer_fa.attention.backends import flash, fused, unfused
from transformer_fa.attention.backends.fused import cudnn_lib
from transformer_fa.attention.selection import SWITCHES

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.device_count() >= 2
         and dist.is_nccl_available()), reason="needs 2 CUDA GPUs and NCCL")

WORLD = 2
SEQ_PER_RANK = 128  # two load-balanced chunks of 64 tokens per rank
CP_SIZES = dict(heads=8, groups=4, dim=64, batch=2)
BF16_TOLERANCE = 5e-2  # as tests/gpu/test_context_parallel_gpu.py, against float64
FP32_TOLERANCE = 1e-3
BACKENDS = (flash.NAME, fused.NAME)


def only(backend=None):
    """The NVTE_* switches allowing only ``backend`` (every backend when None)."""
    return {switch: "1" if backend in (None, name) else "0" for name, switch in SWITCHES.items()}


@contextmanager
def cp_blocks(backend, on_kernels):
    """The CP call with only ``backend`` switched on, then a check of where its blocks ran:
    on that backend's kernels (``on_kernels``: cuDNN or the flash kernels, as the selection
    picks for a block) or in the PyTorch math."""
    context_parallel.last_block_backend = None
    with scoped_env(**only(backend)):
        yield
    expected = backend if on_kernels else unfused.NAME
    assert context_parallel.last_block_backend == expected, (
        f"blocks ran on {context_parallel.last_block_backend}, expected {expected} (flash "
        f"extension: {flash._ext_error or 'loaded'})")


def with_all_backends_on(case):
    """The float64 references need the unfused backend, whatever the caller's environment."""
    def run(world, rank, group):
        with scoped_env(**only()):
            case(world, rank, group)
    return run


def cp_case(comm, mask, fmt, backend, dim=64):
    sizes = dict(CP_SIZES, dim=dim)
    return with_all_backends_on(attention_case(
        comm, mask, fmt, seq_per_rank=SEQ_PER_RANK, sizes=sizes, device="cuda",
        dtype=torch.bfloat16, tol=BF16_TOLERANCE, cp_context=lambda: cp_blocks(backend, True)))


def cp_thd_case(comm, mask, backend):
    return with_all_backends_on(thd_case(
        comm, mask, pad=True, sizes=CP_SIZES, device="cuda", dtype=torch.bfloat16,
        tol=BF16_TOLERANCE, cp_context=lambda: cp_blocks(backend, False)))


def one_gpu_case(mask, fmt, backend):
    """One GPU's bf16 attention on the CP cases' full tensors, with only ``backend`` on: that
    backend runs, within the CP cases' tolerance of the float64 run."""
    def run(world, rank, group):
        full, dout = draw_attention_inputs(SEQ_PER_RANK * world, fmt, device="cuda",
                                           **CP_SIZES)
        sizes = (CP_SIZES["heads"], CP_SIZES["dim"], CP_SIZES["groups"])
        args = dict(qkv_format=fmt, attn_mask_type=mask)
        expected = run_attention(te.DotProductAttention(*sizes, **args), full, dout)
        dpa = te.DotProductAttention(*sizes, **args)
        with scoped_env(**only(backend)):
            got = run_attention(dpa, full, dout, torch.bfloat16)
        assert dpa.last_backend == backend, f"{dpa.last_backend} ran, not {backend}"
        close_outputs(got, expected, lambda t: t, BF16_TOLERANCE)
    return with_all_backends_on(run)


TP_SEQ, TP_BATCH, TP_HIDDEN, TP_HEADS, TP_GROUPS = 16, 2, 128, 8, 4


def tp_stack_case(sp):
    """Two TransformerLayers (GQA, SwiGLU) with set_parallel_mode, float32 on CUDA: input and
    output whole, or this rank's part of the sequence with sequence parallelism."""
    def make(tp):
        mode = dict(set_parallel_mode=True) if tp else {}
        return torch.nn.Sequential(*(
            build(te.TransformerLayer, TP_HIDDEN, 2 * TP_HIDDEN, TP_HEADS, seed=layer,
                  num_gqa_groups=TP_GROUPS, hidden_dropout=0.0, attention_dropout=0.0,
                  activation="swiglu", layer_number=layer + 1, **mode, **tp)
            for layer in range(2)))
    how = "seq" if sp else None

    def run(world, rank, group):
        compare(world, rank, group, make, how, how, sp=sp,
                shape=(TP_SEQ, TP_BATCH, TP_HIDDEN), device="cuda", dtype=torch.float32,
                tol=FP32_TOLERANCE)
    return with_all_backends_on(run)


CASES = {}
for _backend in BACKENDS:
    for _mask in ("causal", "no_mask"):
        for _fmt in ("bshd", "sbhd"):
            CASES[f"one-gpu-{_backend}-{_mask}-{_fmt}"] = one_gpu_case(_mask, _fmt, _backend)
            for _comm in ("p2p", "all_gather", "a2a"):
                CASES[f"cp-{_comm}-{_mask}-{_fmt}-{_backend}"] = cp_case(_comm, _mask, _fmt,
                                                                         _backend)
    for _comm in ("p2p", "all_gather", "a2a"):
        CASES[f"cp-{_comm}-causal-bshd-d128-{_backend}"] = cp_case(_comm, "causal", "bshd",
                                                                   _backend, dim=128)
    for _comm in ("p2p", "all_gather"):
        for _mask in ("causal", "no_mask"):
            CASES[f"cp-{_comm}-{_mask}-thd-{_backend}"] = cp_thd_case(_comm, _mask, _backend)
for _sp in (False, True):
    CASES[f"tp-transformer_layer_stack-{'sp' if _sp else 'tp'}"] = tp_stack_case(_sp)
for _name, _wrap in (("ddp", ddp), ("fsdp2", fsdp2)):
    CASES[_name] = with_all_backends_on(data_parallel_case(
        _wrap, device="cuda", dtype=torch.float32, tol=FP32_TOLERANCE))


@pytest.fixture(scope="module")
def nccl_results():
    return run_cases(__name__, WORLD, backend="nccl")


@pytest.mark.parametrize("case", list(CASES))
def test_distributed_on_gpus(nccl_results, case):
    if fused.NAME in case and cudnn_lib.get() is None:  # an optional extra
        pytest.skip(f"FusedAttention needs cudnn-frontend: {cudnn_lib.import_error()}")
    assert_case_passed(nccl_results, case)
