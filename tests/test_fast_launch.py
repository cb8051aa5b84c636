"""kernels.launch: the cache key of a Triton launch tells apart what Triton specializes on."""
import torch

from transformer_fa.kernels.launch import _spec


def test_key_separates_what_triton_specializes():
    x = torch.zeros(16, dtype=torch.float32)
    assert _spec(x) != _spec(x[1:])  # 16-byte aligned or not
    assert _spec(x) != _spec(x.to(torch.bfloat16))
    assert _spec(1) != _spec(2)  # ints equal to 1 become constants
    assert _spec(16) != _spec(17) and _spec(32) == _spec(48)  # divisibility by 16
    assert _spec(2**31 - 16) != _spec(2**31 + 16)  # int32 or int64
    assert _spec(-2**31) == _spec(16 * 7) and _spec(-2**31 - 16) != _spec(16)
    assert _spec(True) != _spec(False) and _spec(None) != _spec(False)
    assert _spec(0.5) == _spec(2.0)  # floats: one type (fp32), never specialized
    assert _spec(3) == _spec(5)
