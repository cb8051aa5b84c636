"""The host work of one plain DotProductAttention call, down each backend's Python path on CPU
(benchmarks/bench_host.py's stand-ins answer for the CUDA extension and cuDNN):

- budgets of Python calls into transformer_fa and of torch ops per call (a regression
  guard, as tests/test_decode_host.py's: performance is measured by benchmarks/bench_host.py,
  never asserted by a timed test);
- what the call remembers between calls is keyed completely: a variable, mode or setting
  changed between two calls changes what runs, a bad input still raises after good calls,
  and the debug log still says what was selected whenever a decision is made.
"""
import dataclasses
import logging
import sys
from pathlib import Path

import pytest
import torch

import transformer_fa as tfa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import bench_host  # noqa: E402
from benchmarks.bench_host import Row  # noqa: E402

FLASH, FUSED, UNFUSED = bench_host.BACKENDS

# bench_host's rows at small sizes (the counts do not depend on them): a decode step (runs
# on FlashAttention's split-KV decode kernel without grad) and a prefill.
ROWS = {
    "decode": Row("decode", 1, 1, 64, 8, 2, 64, "no_mask", False),
    "decode-grad": Row("decode", 1, 1, 64, 8, 2, 64, "no_mask", True),
    "prefill": Row("prefill", 2, 128, 128, 4, 4, 64, "causal", False),
    "prefill-grad": Row("prefill", 2, 128, 128, 4, 4, 64, "causal", True),
}

# Measured on 2026-12-01 (Python 3.11, torch 2.13 CPU): Python calls into transformer_fa per
# call, by row and backend, with the backends' bound runners on remembered calls (`bind`).
# Before them (2026-11-28): FlashAttention 30 / 31 / 31 / 31, FusedAttention 21 / 22; before
# the cuts of that day (the dense-call key without generators, FlashAttention's remembered
# FlashCall and decode choice, the alignment check's contiguous shortcut, ...): FlashAttention
# 58 / 56 / 59 / 56, FusedAttention 28, unfused 35.
OUR_CALLS = {
    FLASH: {"decode": 19, "decode-grad": 26, "prefill": 19, "prefill-grad": 26},
    FUSED: {"decode": 18, "decode-grad": 19, "prefill": 18, "prefill-grad": 19},
    UNFUSED: {"decode": 29, "decode-grad": 29, "prefill": 29, "prefill-grad": 29},
}
# Torch ops per call (views included): FlashAttention's merge of the heads (and the
# autograd node's); FusedAttention's output and, with grad, its softmax stats (it made an
# empty stats tensor on forward-only calls too before); the unfused math as it is.
OPS = {
    FLASH: {"decode": 1, "decode-grad": 2, "prefill": 1, "prefill-grad": 2},
    FUSED: {"decode": 2, "decode-grad": 4, "prefill": 2, "prefill-grad": 4},
    UNFUSED: {"decode": 47, "decode-grad": 48, "prefill": 52, "prefill-grad": 53},
}


@pytest.fixture
def ext():
    with bench_host.stand_ins() as stand_in:
        yield stand_in


@pytest.mark.parametrize("backend", bench_host.BACKENDS)
@pytest.mark.parametrize("row", ROWS)
def test_call_stays_within_its_budget(ext, row, backend):
    call = bench_host.setup(ROWS[row], backend)
    with bench_host.only_backend(backend):
        _, ours = bench_host.python_calls_per_call(call)
        ops = sum(bench_host.ops_per_call(call).values())
    assert ours <= OUR_CALLS[backend][row], f"{ours} Python calls into transformer_fa"
    assert ops <= OPS[backend][row], f"{ops} torch ops"


def set_env(monkeypatch, name, value):
    """Sets name to value, or unsets it where value is None."""
    if value is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, value)


def decode_call(**module_kwargs):
    row = ROWS["decode"]
    q = torch.randn(row.b, row.sq, row.hq, row.d, dtype=torch.bfloat16)
    k, v = (torch.randn(row.b, row.sk, row.hkv, row.d, dtype=torch.bfloat16) for _ in range(2))
    module_kwargs.setdefault("attn_mask_type", row.mask)
    dpa = tfa.DotProductAttention(row.hq, row.d, num_gqa_groups=row.hkv, qkv_format="bshd",
                                  **module_kwargs)
    return dpa, q, k, v


def test_switches_between_calls_change_the_backend(ext, monkeypatch):
    dpa, q, k, v = decode_call()
    ran = []
    for switches in ({}, {"NVTE_FLASH_ATTN": "0"}, {"NVTE_FLASH_ATTN": "0", "NVTE_FUSED_ATTN": "0"},
                     {}):
        for name in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN"):
            set_env(monkeypatch, name, switches.get(name))
        for _ in range(2):  # the second call is the remembered one
            dpa(q, k, v)
            ran.append(dpa.last_backend)
    assert ran == [FLASH] * 2 + [FUSED] * 2 + [UNFUSED] * 2 + [FLASH] * 2


def test_kernel_families_between_calls_change_the_flash_call(ext, monkeypatch):
    """TRANSFORMER_FA_FLASH_FAMILY decides between the decode kernel and a family's forward;
    TRANSFORMER_FA_FLASH_BWD_FAMILY reaches the backward's call."""
    dpa, q, k, v = decode_call()
    for family, entry, code in ((None, "fwd_kvcache", None), ("sm80", "fwd", 80),
                                ("sm90", "fwd", 90), (None, "fwd_kvcache", None)):
        set_env(monkeypatch, "TRANSFORMER_FA_FLASH_FAMILY", family)
        for _ in range(2):
            ext.last = None
            dpa(q, k, v)
            assert dpa.last_backend == FLASH and ext.last[0] == entry, family
            if code is not None:
                assert ext.last[1][-1] == code  # the binding's family argument
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    for family, kwargs in ((None, {}), ("sm80", {"family": 80}), (None, {})):
        set_env(monkeypatch, "TRANSFORMER_FA_FLASH_BWD_FAMILY", family)
        for _ in range(2):
            dpa(q, k, v).sum().backward()
            assert ext.last[0] == "bwd" and ext.last[2] == kwargs, family


def test_deterministic_mode_between_calls_reaches_the_backward(ext, monkeypatch):
    dpa, q, k, v = decode_call()
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    deterministic_arg = -2  # the binding's bwd(..., deterministic, grads)
    seen = []

    def backward():
        dpa(q, k, v).sum().backward()
        seen.append(ext.last[1][deterministic_arg])

    backward()
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    backward()
    monkeypatch.delenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO")
    backward()
    try:
        torch.use_deterministic_algorithms(True, warn_only=True)
        backward()
    finally:
        torch.use_deterministic_algorithms(False)
    backward()
    assert seen == [False, True, False, True, False]


def test_module_settings_between_calls_change_the_flash_call(ext):
    """softmax_scale and the diagonal's alignment (bottom_right_diagonal is in the key of
    remembered calls: a top-left window is the unfused reference's only)."""
    dpa, q, k, v = decode_call(attn_mask_type="no_mask", window_size=(8, 8))
    scales = []
    for scale in (0.5, 0.25):
        dpa.softmax_scale = scale
        for _ in range(2):
            dpa(q, k, v)
            scales.append(ext.last[1][10])  # the binding's softmax_scale
    assert scales == [0.5, 0.5, 0.25, 0.25]
    ran = []
    for diagonal in (None, False, True, None):
        dpa.bottom_right_diagonal = diagonal
        for _ in range(2):
            dpa(q, k, v)
            ran.append(dpa.last_backend)
    assert ran == [FLASH] * 2 + [UNFUSED] * 2 + [FLASH] * 4


BAD_AFTER_GOOD = [
    ("dtype", lambda q, k, v: (q, k.float(), v), TypeError, "key_layer dtype"),
    ("heads", lambda q, k, v: (q[:, :, :4], k, v), ValueError, "num_attention_heads=8"),
    ("batch", lambda q, k, v: (q, k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1)),
     ValueError, "batch"),
    ("last stride", lambda q, k, v: (q, k, v.transpose(-1, -2).contiguous().transpose(-1, -2)),
     ValueError, "stride 1 in its last"),
]


@pytest.mark.parametrize("name,bad,error,match", BAD_AFTER_GOOD, ids=[b[0] for b in BAD_AFTER_GOOD])
def test_bad_input_still_raises_after_remembered_calls(ext, name, bad, error, match):
    dpa, q, k, v = decode_call()
    for _ in range(2):
        dpa(q, k, v)
    with pytest.raises(error, match=match):
        dpa(*bad(q, k, v))
    dpa(q, k, v)  # and the good call runs again
    assert dpa.last_backend == FLASH


def test_debug_log_names_the_backend_whenever_a_decision_is_made(ext, monkeypatch):
    """Once per decision, as before: a remembered call logs nothing, a changed switch or
    log level decides (and logs) again."""
    lines = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("DotProductAttention")
    logger.addHandler(handler)
    try:
        monkeypatch.setenv("NVTE_DEBUG", "1")
        monkeypatch.setenv("NVTE_DEBUG_LEVEL", "2")
        dpa, q, k, v = decode_call()
        dpa(q, k, v)
        assert "Selected backend = FlashAttention" in lines
        assert "FlashAttention decode kernel (split-KV, sm80 family)" in lines
        assert any(line.startswith("Running with config=") for line in lines)
        lines.clear()
        dpa(q, k, v)
        assert lines == []
        monkeypatch.setenv("NVTE_FLASH_ATTN", "0")
        dpa(q, k, v)
        assert "Selected backend = FusedAttention" in lines
        lines.clear()
        monkeypatch.setenv("NVTE_DEBUG_LEVEL", "1")
        dpa(q, k, v)
        assert lines == ["Selected backend = FusedAttention"]
    finally:
        logger.removeHandler(handler)


def unaligned_like(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of t whose storage (offset 0, so the call key of t) starts 2 bytes
    past a 16-byte boundary."""
    nbytes = t.numel() * t.element_size()
    buf = bytearray(nbytes + 32)
    skip = (-torch.frombuffer(buf, dtype=torch.uint8).data_ptr()) % 16 + 2
    out = torch.frombuffer(buf, dtype=t.dtype, offset=skip, count=t.numel()).view(t.shape)
    out._buffer = buf  # kept alive with the tensor
    return out.copy_(t)


@pytest.mark.parametrize("grad", [False, True], ids=["decode", "grad"])
def test_remembered_calls_run_bound_and_copy_misaligned_pointers(ext, grad):
    """A remembered dense call runs the backend's bound runner (FlashAttention's binding
    gets the tensors themselves); a later call with the same key but a data pointer off a
    16-byte boundary gets a contiguous copy from run() instead, as a first call would."""
    dpa, q, k, v = decode_call()
    if grad:
        q, k, v = (t.requires_grad_() for t in (q, k, v))
    entry = "fwd" if grad else "fwd_kvcache"
    for _ in range(2):
        dpa(q, k, v)
        assert ext.last[0] == entry and ext.last[1][0] is q and ext.last[1][1] is k
    (_, _, runner), = dpa._dense_calls.values()
    assert runner is not None
    k_off = unaligned_like(k.detach()).requires_grad_(grad)
    assert k_off.data_ptr() % 16 == 2 and k_off.stride() == k.stride()
    dpa(q, k_off, v)
    assert len(dpa._dense_calls) == 1  # the same key
    given_k = ext.last[1][1]
    assert given_k is not k_off and given_k.data_ptr() % 16 == 0 and torch.equal(given_k, k_off)


@pytest.mark.parametrize("change", [dict(attention_dropout=0.1), dict(softmax_type="off-by-one"),
                                    dict(core_attention_bias_type="alibi"),
                                    dict(is_compiling=True)],
                         ids=["dropout", "softmax_offset", "alibi", "compiling"])
def test_calls_a_runner_could_not_serve_are_not_bound(change):
    """bind() declines the calls whose runner would need more than q, k, v (a dropout draw,
    a bias, the softmax offset) or that are traced: those keep going through run()."""
    from test_flash_support import gpu_params
    from transformer_fa.attention.backends import flash, fused
    from transformer_fa.attention.backends.support import bindable
    from transformer_fa.attention.params import AttentionInputs
    p = gpu_params(head_dim_qk=64, head_dim_v=64, max_seqlen_q=128, max_seqlen_kv=128)
    assert bindable(p)
    changed = dataclasses.replace(p, **change)
    assert not bindable(changed)
    q = k = v = torch.zeros(1, 128, 4, 64, dtype=torch.bfloat16)
    for backend in (flash, fused):
        assert backend.bind(AttentionInputs(q, k, v), changed) is None
