"""The modules on CUDA, where cuBLAS picks its GEMM by the operands' strides."""
import pytest
import torch

import transformer_fa as te

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_linear_gradients_do_not_depend_on_input_strides():
    """A transposed (non-contiguous) input gives bitwise the same output and weight gradient
    as its contiguous copy (TE's test_noncontiguous): the GEMMs read a contiguous input."""
    torch.manual_seed(0)
    a = torch.randn(128, 256, device="cuda", requires_grad=True).T
    b = a.detach().contiguous()
    l1, l2 = te.Linear(128, 128), te.Linear(128, 128)
    l2.load_state_dict(l1.state_dict())
    out1, out2 = l1(a), l2(b)
    out1.sum().backward()
    out2.sum().backward()
    assert torch.equal(out1, out2)
    assert torch.equal(l1.weight.grad, l2.weight.grad)
    assert torch.equal(l1.bias.grad, l2.bias.grad)
