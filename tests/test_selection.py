"""Backend selection, env switches, TE-style logs, bad input (torch.compile: test_compile.py)."""
import logging

import pytest
import torch

import transformer_fa as tfa
from transformer_fa.attention import selection
from transformer_fa.attention.backends import unfused


class Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture
def log_lines():
    handler = Capture()
    logger = logging.getLogger("DotProductAttention")
    logger.addHandler(handler)
    yield handler.lines
    logger.removeHandler(handler)


def qkv(s=6, b=2, h=2, d=8, **kw):
    return [torch.randn(s, b, h, d, **kw) for _ in range(3)]


def test_cpu_selects_unfused_and_logs_te_lines(monkeypatch, log_lines):
    monkeypatch.setenv("NVTE_DEBUG", "1")
    monkeypatch.setenv("NVTE_DEBUG_LEVEL", "2")
    dpa = tfa.DotProductAttention(2, 8)
    dpa(*qkv())
    assert dpa.last_backend == "UnfusedDotProductAttention"
    assert any(line.startswith("Running with config=") and "'qkv_layout': 'sbhd_sbhd_sbhd'" in line
               for line in log_lines)
    assert any(line.startswith("Disabling FlashAttention as it requires CUDA") for line in log_lines)
    assert any(line.startswith("Disabling FusedAttention ") for line in log_lines)
    assert ("Available backends = {FlashAttention=False, FusedAttention=False, "
            "UnfusedDotProductAttention=True}") in log_lines
    assert "Selected backend = UnfusedDotProductAttention" in log_lines


def test_log_level_follows_env_on_every_call(monkeypatch, log_lines):
    dpa = tfa.DotProductAttention(2, 8)
    dpa(*qkv())
    assert log_lines == []  # NVTE_DEBUG unset: warnings only
    monkeypatch.setenv("NVTE_DEBUG", "1")
    monkeypatch.setenv("NVTE_DEBUG_LEVEL", "1")
    dpa(*qkv())
    assert log_lines == ["Selected backend = UnfusedDotProductAttention"]


def test_switch_off_removes_backend_and_error_names_reasons(monkeypatch, log_lines):
    monkeypatch.setenv("NVTE_DEBUG", "1")
    monkeypatch.setenv("NVTE_DEBUG_LEVEL", "2")
    monkeypatch.setenv("NVTE_UNFUSED_ATTN", "0")
    dpa = tfa.DotProductAttention(2, 8)
    with pytest.raises(ValueError, match="No dot product attention backend is available for the "
                                         "provided inputs.*NVTE_UNFUSED_ATTN=0"):
        dpa(*qkv())
    assert "Disabling UnfusedDotProductAttention due to NVTE_UNFUSED_ATTN=0" in log_lines
    monkeypatch.setenv("NVTE_UNFUSED_ATTN", "1")  # read again on the next call
    dpa(*qkv())
    assert dpa.last_backend == "UnfusedDotProductAttention"


def test_decision_is_cached_per_params(monkeypatch):
    calls = []
    real = selection._decide
    monkeypatch.setattr(selection, "_decide", lambda p, e: calls.append(p) or real(p, e))
    dpa = tfa.DotProductAttention(2, 8)
    for _ in range(3):
        dpa(*qkv())
    assert len(calls) == 1
    dpa(*qkv(s=7))
    assert len(calls) == 2


def test_deterministic_flag(monkeypatch):
    seen = []
    real = selection._decide
    monkeypatch.setattr(selection, "_decide", lambda p, e: seen.append(p) or real(p, e))
    dpa = tfa.DotProductAttention(2, 8)
    dpa(*qkv())
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    dpa(*qkv())
    assert [p.deterministic for p in seen] == [False, True]


def test_dropout_only_in_training_params(monkeypatch):
    seen = []
    real = selection._decide
    monkeypatch.setattr(selection, "_decide", lambda p, e: seen.append(p) or real(p, e))
    dpa = tfa.DotProductAttention(2, 8, attention_dropout=0.2)
    dpa(*qkv())
    dpa.eval()
    dpa(*qkv())
    assert [p.attention_dropout for p in seen] == [0.2, 0.0]


BAD_INPUTS = [
    ("rank", lambda: [torch.randn(6, 2, 16)] * 3, {}, ValueError, "query_layer must have 4 dims"),
    ("heads", lambda: qkv(h=3), {}, ValueError, "num_attention_heads=2"),
    ("kv heads", lambda: [torch.randn(6, 2, 2, 8), torch.randn(6, 2, 1, 8), torch.randn(6, 2, 1, 8)],
     {}, ValueError, "num_gqa_groups=2"),
    ("head dim", lambda: qkv(d=4), {}, ValueError, "kv_channels=8"),
    ("dtype", lambda: [torch.randn(6, 2, 2, 8), torch.randn(6, 2, 2, 8).double(),
                       torch.randn(6, 2, 2, 8)], {}, TypeError, "key_layer dtype"),
    ("int", lambda: [torch.ones(6, 2, 2, 8, dtype=torch.int64)] * 3, {}, TypeError, "floating point"),
    ("last stride", lambda: [torch.randn(6, 2, 8, 2).transpose(-1, -2)] * 3, {}, ValueError,
     "stride 1 in its last"),
    ("device", lambda: [torch.randn(6, 2, 2, 8), torch.randn(6, 2, 2, 8, device="meta"),
                        torch.randn(6, 2, 2, 8)], {}, ValueError, "key_layer is on meta"),
    ("not tensor", lambda: [torch.randn(6, 2, 2, 8), [1.0], torch.randn(6, 2, 2, 8)], {}, TypeError,
     "key_layer must be a torch.Tensor"),
    ("format", lambda: qkv(), {"qkv_format": "bhsd"}, ValueError, "qkv_format must be one of"),
    ("mask type", lambda: qkv(), {"attn_mask_type": "diagonal"}, ValueError, "attn_mask_type must"),
    ("window", lambda: qkv(), {"attn_mask_type": "no_mask", "window_size": (-2, 0)}, ValueError,
     "window_size entries"),
    ("padding mask shape", lambda: qkv(), {"attn_mask_type": "padding",
                                           "attention_mask": torch.zeros(2, 1, 6, dtype=torch.bool)},
     ValueError, "shape \\[b, 1, 1, s\\]"),
    ("left padded", lambda: qkv(), {"attn_mask_type": "padding", "attention_mask":
                                    torch.tensor([True] + [False] * 5).expand(2, 1, 1, 6)},
     ValueError, "right-padded"),
    ("arbitrary needs mask", lambda: qkv(), {"attn_mask_type": "arbitrary"}, TypeError,
     "needs attention_mask"),
    ("bias missing", lambda: qkv(), {"core_attention_bias_type": "post_scale_bias"}, TypeError,
     "needs core_attention_bias"),
    ("bias shape", lambda: qkv(), {"core_attention_bias_type": "post_scale_bias",
                                   "core_attention_bias": torch.zeros(1, 2, 6, 5)}, ValueError,
     "core_attention_bias must have shape"),
    ("bias type", lambda: qkv(), {"core_attention_bias_type": "bias"}, ValueError,
     "core_attention_bias_type must be one of"),
    ("alibi dtype", lambda: qkv(), {"core_attention_bias_type": "alibi",
                                    "alibi_slopes": torch.ones(2, dtype=torch.float64)}, TypeError,
     "alibi_slopes must be a float32"),
    ("inference", lambda: qkv(), {"inference_params": object()}, TypeError,
     "inference_params must be a transformer_fa.InferenceParams"),
]


@pytest.mark.parametrize("name,make,kwargs,error,match", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_is_named(name, make, kwargs, error, match):
    dpa = tfa.DotProductAttention(2, 8)
    with pytest.raises(error, match=match):
        dpa(*make(), **kwargs)


def thd_inputs(t=9):
    return [torch.randn(t, 2, 8) for _ in range(3)]


@pytest.mark.parametrize("cu,error,match", [
    (None, ValueError, "cu_seqlens_q is required"),
    (torch.tensor([0, 4, 9], dtype=torch.int64), TypeError, "cu_seqlens_q must be int32"),
    (torch.tensor([[0, 4, 9]], dtype=torch.int32), ValueError, "cu_seqlens_q must be 1-D"),
    (torch.tensor([0, 5, 4], dtype=torch.int32), ValueError, "never decrease"),
    (torch.tensor([1, 4, 9], dtype=torch.int32), ValueError, "start at 0"),
    (torch.tensor([0, 4, 12], dtype=torch.int32), ValueError, "has only 9 tokens"),
])
def test_bad_cu_seqlens(cu, error, match):
    dpa = tfa.DotProductAttention(2, 8, qkv_format="thd")
    good = torch.tensor([0, 4, 9], dtype=torch.int32)
    with pytest.raises(error, match=match):
        dpa(*thd_inputs(), cu_seqlens_q=cu, cu_seqlens_kv=good)


def test_max_seqlen_too_small():
    dpa = tfa.DotProductAttention(2, 8, qkv_format="thd")
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    with pytest.raises(ValueError, match="max_seqlen_q=3 is less than the longest sequence"):
        dpa(*thd_inputs(), cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=3)


@pytest.mark.parametrize("kwargs,match", [
    ({"num_attention_heads": 6, "kv_channels": 8, "num_gqa_groups": 4}, "divisible"),
    ({"num_attention_heads": 0, "kv_channels": 8}, "num_attention_heads must be a positive"),
    ({"num_attention_heads": 2, "kv_channels": (8, 8, 8)}, "kv_channels must be"),
    ({"num_attention_heads": 2, "kv_channels": 8, "attention_dropout": 1.5}, "attention_dropout"),
    ({"num_attention_heads": 2, "kv_channels": 8, "attention_type": "both"}, "attention_type"),
])
def test_bad_constructor_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        tfa.DotProductAttention(**kwargs)


def test_repeated_calls_follow_env_mode_and_layout_changes(monkeypatch):
    """The cached fast path for dense calls must see every change that matters."""
    dpa = tfa.DotProductAttention(2, 8, attn_mask_type="no_mask", attention_dropout=0.5)
    dpa.eval()
    fresh = lambda: tfa.DotProductAttention(2, 8, attn_mask_type="no_mask").eval()  # noqa: E731
    q, k, v = qkv()
    for _ in range(2):
        torch.testing.assert_close(dpa(q, k, v), fresh()(q, k, v))
    dpa.train()  # dropout now applies
    assert not torch.allclose(dpa(q, k, v), fresh()(q, k, v))
    dpa.eval()
    monkeypatch.setenv("NVTE_UNFUSED_ATTN", "0")
    with pytest.raises(ValueError, match="No dot product attention backend"):
        dpa(q, k, v)
    monkeypatch.delenv("NVTE_UNFUSED_ATTN")
    # Packed views, then separate tensors with the very same strides and offsets in
    # different storages, then a fused GQA-style split: each read right, every time.
    buf = torch.randn(6, 2, 3, 2, 8)
    packed = buf.unbind(2)
    separate = [torch.empty(buf.numel()).as_strided(p.shape, p.stride(), p.storage_offset())
                for p in packed]
    for t, p in zip(separate, packed):
        t.copy_(p * 2)
    split = torch.randn(6, 2, 6, 8).split(2, dim=2)
    layouts = []
    real_run = unfused.run
    monkeypatch.setattr(unfused, "run", lambda i, p: layouts.append(p.qkv_layout) or real_run(i, p))
    for inputs, layout in ((packed, "sb3hd"), (separate, "sbhd_sbhd_sbhd"), (packed, "sb3hd"),
                           (split, "sb3hd"), (separate, "sbhd_sbhd_sbhd")):
        for _ in range(2):
            layouts.clear()
            torch.testing.assert_close(dpa(*inputs), fresh()(*[t.contiguous() for t in inputs]))
            assert layouts[0] == layout


def test_changed_module_settings_are_seen_by_repeated_calls():
    q, k, v = qkv()
    dpa = tfa.DotProductAttention(2, 8, attn_mask_type="no_mask")
    dpa(q, k, v)
    dpa.attn_mask_type = "causal"  # a later change of the module's defaults must count
    torch.testing.assert_close(dpa(q, k, v),
                               tfa.DotProductAttention(2, 8, attn_mask_type="causal")(q, k, v))
    dpa.window_size = (1, 0)
    torch.testing.assert_close(
        dpa(q, k, v), tfa.DotProductAttention(2, 8, attn_mask_type="causal",
                                              window_size=(1, 0))(q, k, v))


# ---------------------------------------------------------------------------------------------
# The Hopper preference: FusedAttention first, FlashAttention where measured faster
# ---------------------------------------------------------------------------------------------
class FwdFamily:
    """A stand-in of the binding's fwd_family and bwd_family rules: fixed answers."""

    def __init__(self, family, bwd="sm90"):
        self.family = family
        self.bwd = bwd

    def fwd_family(self, *args):
        return [self.family, "" if self.family == "sm90" else "why"]

    def bwd_family(self, *args):
        return [self.bwd, "" if self.bwd == "sm90" else "why"]


def hopper_params(**changes):
    from test_flash_support import gpu_params
    base = dict(head_dim_qk=64, head_dim_v=64, max_seqlen_q=4096, max_seqlen_kv=4096,
                attn_mask_type="no_mask", window_size=(-1, -1), requires_grad=False)
    base.update(changes)
    return gpu_params(**base)


@pytest.fixture
def sm90_rule(monkeypatch):
    from transformer_fa.attention.backends import flash
    rule = FwdFamily("sm90")
    monkeypatch.setattr(flash, "_extension", lambda: rule)
    monkeypatch.delenv("TRANSFORMER_FA_FLASH_FAMILY", raising=False)
    return rule


CAUSAL = dict(attn_mask_type="causal", window_size=(-1, 0))


@pytest.mark.parametrize("d,mask,shortest", [(64, {}, 2048), (64, CAUSAL, 4096),
                                             (128, {}, 16384), (128, CAUSAL, 2048),
                                             (256, CAUSAL, 4096)])
def test_flash_goes_first_on_hopper_from_the_measured_length(sm90_rule, d, mask, shortest):
    from transformer_fa.attention.backends import flash, fused
    for s, first in ((shortest // 2, fused), (shortest, flash), (2 * shortest, flash)):
        p = hopper_params(head_dim_qk=d, head_dim_v=d, max_seqlen_q=s, max_seqlen_kv=s, **mask)
        assert selection.preference_order(p)[0] is first, (d, mask, s)
        assert (flash.faster_than_cudnn(p) is None) == (first is fused)


@pytest.mark.parametrize("d,mask,shortest", [(64, {}, 2048), (64, CAUSAL, 512),
                                             (256, {}, 8192), (256, CAUSAL, 16384)],
                         ids=["d64-no_mask", "d64-causal", "d256-no_mask", "d256-causal"])
def test_flash_goes_first_on_hopper_for_training_from_the_measured_length(sm90_rule, d, mask,
                                                                          shortest):
    from transformer_fa.attention.backends import flash, fused
    for s, first in ((shortest // 2, fused), (shortest, flash), (2 * shortest, flash)):
        p = hopper_params(head_dim_qk=d, head_dim_v=d, max_seqlen_q=s, max_seqlen_kv=s,
                          requires_grad=True, **mask)
        assert selection.preference_order(p)[0] is first, s
    assert "forward and backward were measured faster" in flash.faster_than_cudnn(p)


@pytest.mark.parametrize("change", [
    dict(deterministic=True),                       # not measured against cuDNN's own
    dict(head_dim_qk=128, head_dim_v=128),          # below cuDNN's in places
    dict(head_dim_qk=192, head_dim_v=192),          # d192: below cuDNN
])
def test_training_keeps_cudnn_first_on_hopper_elsewhere(sm90_rule, change):
    from transformer_fa.attention.backends import flash, fused
    p = hopper_params(max_seqlen_q=16384, max_seqlen_kv=16384, requires_grad=True, **change)
    assert flash.faster_than_cudnn(p) is None
    assert selection.preference_order(p)[0] is fused


def test_training_keeps_cudnn_first_when_the_sm80_backward_would_run(sm90_rule):
    from transformer_fa.attention.backends import flash
    sm90_rule.bwd = "sm80"
    p = hopper_params(max_seqlen_q=16384, max_seqlen_kv=16384, requires_grad=True)
    assert flash.faster_than_cudnn(p) is None


@pytest.mark.parametrize("change", [
    dict(requires_grad=True, max_seqlen_q=1024, max_seqlen_kv=1024),  # training: from 2k
    dict(dtype=torch.float16),                      # measured in bf16 only
    dict(num_gqa_groups=2),                         # GQA
    dict(max_seqlen_kv=8192),                       # sq != skv
    dict(attn_mask_type="padding", window_size=(-1, -1)),  # varlen
    dict(q_format="thd", kv_format="thd", qkv_format="thd", qkv_layout="thd_thd_thd"),
    dict(window_size=(128, 0), attn_mask_type="causal"),   # a sliding window
    dict(head_dim_qk=128, head_dim_v=128),          # d128: below cuDNN in some runs
    dict(head_dim_qk=32, head_dim_v=32),            # padded to the d64 kernel: not measured
    dict(head_dim_qk=64, head_dim_v=32),
    dict(core_attention_bias_type="alibi", alibi_slopes_shape=(4,)),
    dict(attention_dropout=0.1),
    dict(compute_capability=(10, 0)),               # not the GPU it was measured on
])
def test_fused_stays_first_on_hopper_elsewhere(sm90_rule, change):
    from transformer_fa.attention.backends import flash, fused
    p = hopper_params(**change)
    assert flash.faster_than_cudnn(p) is None
    if p.compute_capability == (9, 0):
        assert selection.preference_order(p)[0] is fused


def test_flash_is_not_preferred_when_its_sm80_family_would_run(sm90_rule):
    from transformer_fa.attention.backends import flash, fused
    sm90_rule.family = "sm80"
    p = hopper_params()
    assert flash.faster_than_cudnn(p) is None
    assert selection.preference_order(p)[0] is fused


def test_the_backward_family_between_calls_changes_the_hopper_preference(monkeypatch):
    """A backward family asked for by name that is not sm90 sends a training call that
    FlashAttention would take on Hopper back to cuDNN: the decision remembered under one
    TRANSFORMER_FA_FLASH_BWD_FAMILY must not serve another."""
    from transformer_fa.attention.backends import flash, fused
    from transformer_fa.attention.params import FIELD_NAMES

    class Rules(FwdFamily):  # the binding's rule: the backward family asked for wins
        def bwd_family(self, *args):
            return ["sm80", "asked for"] if args[-1] == 80 else ["sm90", ""]

    monkeypatch.setattr(flash, "_extension", lambda: Rules("sm90"))
    for backend in (flash, fused):  # both can run (no GPU here to ask)
        monkeypatch.setattr(backend, "not_supported_reasons", lambda p: [])
    params = hopper_params(max_seqlen_q=8192, max_seqlen_kv=8192, requires_grad=True)
    fields = tuple(getattr(params, name) for name in FIELD_NAMES)
    chosen = []
    for family in (None, "sm80", None):
        if family is None:
            monkeypatch.delenv("TRANSFORMER_FA_FLASH_BWD_FAMILY", raising=False)
        else:
            monkeypatch.setenv("TRANSFORMER_FA_FLASH_BWD_FAMILY", family)
        chosen.append(selection.select(fields, selection.read_env())[0])
    assert chosen == [flash, fused, flash]


def test_flash_goes_first_off_hopper():
    from transformer_fa.attention.backends import flash
    assert selection.preference_order(hopper_params(compute_capability=(8, 0)))[0] is flash


def test_the_hopper_preference_is_in_the_debug_log(sm90_rule, log_lines):
    selection._configure_logging(logging.DEBUG)
    both = {"FlashAttention": True, "FusedAttention": True, "UnfusedDotProductAttention": True}
    selection._log_hopper_preference(hopper_params(), both)
    assert log_lines[-1] == (
        "Preferring FlashAttention to FusedAttention on Hopper: its sm90 forward was measured "
        "faster than cuDNN for forward-only bf16 calls at head dim 64 from s = 2048 (H200, "
        "2026-12-01)")
    selection._log_hopper_preference(
        hopper_params(requires_grad=True, max_seqlen_q=1024, max_seqlen_kv=1024), both)
    assert log_lines[-1].startswith("Preferring FusedAttention to FlashAttention on Hopper: "
                                    "cuDNN was measured faster for this call shape")
    count = len(log_lines)
    selection._log_hopper_preference(hopper_params(), dict(both, FusedAttention=False))
    assert len(log_lines) == count  # one of the two cannot run: nothing to prefer
