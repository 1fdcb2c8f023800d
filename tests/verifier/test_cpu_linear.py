"""prepacked_linears: same fp32 results as torch's kernels, only on eligible modules, and undone on exit."""

import pytest
import torch
from torch import nn

from eagle3_hf.verifier.cpu_linear import _PACKED, available, prepacked_linears

pytestmark = pytest.mark.skipif(not available(), reason="oneDNN linear ops not available in this torch build")


def test_prepacked_linears_match_torch_and_are_restored():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8, bias=False), nn.Linear(8, 8).bfloat16())
    x = torch.randn(1, 4, 16)
    with torch.inference_mode():
        reference = model[:3](x)
        with prepacked_linears(model, "not a module"):
            assert "forward" in vars(model[0]) and "forward" in vars(model[2])
            assert "forward" not in vars(model[3])  # bf16 stays on torch's kernels
            out = model[:3](x)
            assert model[0] in _PACKED
            with torch.no_grad():
                model[2].weight.mul_(2)  # a changed weight is packed again
            doubled = model[:3](x)
    assert not any("forward" in vars(m) for m in model)
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(doubled, 2 * reference, rtol=1e-5, atol=1e-6)


def test_gradients_inside_the_block_equal_torch_gradients():
    torch.manual_seed(0)
    layer = nn.Linear(4, 2)
    x, w = torch.randn(3, 4), torch.randn(3, 2)
    (layer(x) * w).sum().backward()
    expected = layer.weight.grad.clone(), layer.bias.grad.clone()
    layer.zero_grad()
    with prepacked_linears(layer):
        assert "forward" in vars(layer)  # the packed forward is in place, and must still train correctly
        (layer(x) * w).sum().backward()
    torch.testing.assert_close(layer.weight.grad, expected[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(layer.bias.grad, expected[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(expected[0], w.T @ x)  # and torch's own gradient is the analytic one
