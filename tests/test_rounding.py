"""``bodies.rounded``: FP32 rounded to bf16 / fp16 with integer ops on the bits, the same
values as ``x.to(dtype)`` bit for bit, eager and compiled by Inductor (NOTE [rounding FP32
to the model dtype in a body]: torch 2.11's C++ code keeps a plain ``.to(bf16)`` in FP32
inside a body).  And the ``"fp32_tiles"`` backward, whose logits tile it rounds, no further
from FP64 than stock Inductor on the spelling where torch 2.11 showed it."""

import pytest
import torch

from fx_passes.kernels.log_softmax.bodies import rounded
from fx_passes.testing import rl_spellings as rs
from tests.numerics import assert_no_less_accurate, reference, run

DTYPES = [torch.bfloat16, torch.float16]


def _values() -> torch.Tensor:
    """Random values over many binades, each dtype's ties and neighbours, fp16's subnormal
    and overflow edges, zeros, infinities and NaN."""
    g = torch.Generator().manual_seed(0)
    binades = torch.randint(-30, 30, (20000,), generator=g).float()
    spread = torch.randn(20000, generator=g) * torch.exp2(binades)
    grid = []
    for dt in DTYPES:
        base = torch.randn(2000, generator=g).to(dt).float()
        up = torch.nextafter(base.to(dt), torch.full_like(base.to(dt), float("inf"))).float()
        mid = (base + up) / 2  # ties: round to even
        grid += [base, up, mid, torch.nextafter(mid, up), torch.nextafter(mid, base)]
    tiny = torch.linspace(-2.0**-13, 2.0**-13, 4001)  # fp16's subnormals and the normal edge
    edges = torch.tensor([65504.0, 65519.0, 65520.0, 65536.0, 1e30, -65520.0, 0.0, -0.0, 2.0**-24,
                          3 * 2.0**-25, 2.0**-25, float("inf"), float("-inf"), 3.4e38])
    return torch.cat([spread, *grid, tiny, edges, -edges])


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_rounded_is_to_dtype_bit_for_bit(dtype):
    x = _values()
    want = x.to(dtype)
    assert torch.equal(rounded(x, dtype).view(torch.int16), want.view(torch.int16))
    torch._dynamo.reset()
    compiled = torch.compile(lambda v: rounded(v * 1.0, dtype).float(),
                             options={"emulate_precision_casts": True})
    assert torch.equal(compiled(x).to(dtype).view(torch.int16), want.view(torch.int16))
    nan = torch.tensor([float("nan")])
    assert rounded(nan, dtype).isnan().all() and compiled(nan).isnan().all()


def test_the_fp32_tiles_backward_is_as_accurate_as_stock():
    """The spelling on which torch 2.11 showed the FP32 logits tile unrounded: the
    gradients' max error was 1.4x and 2.1x stock's, now stock's."""
    fn, inputs = rs.inputs("in_place_temperature", 4, 16, 32, 1024)
    ref = reference(fn, inputs, (0, 1))
    torch._dynamo.reset()
    stock = run(torch.compile(fn, backend="inductor"), inputs, (0, 1))
    torch._dynamo.reset()
    options = {"leave_to_stock": False, "lm_head_plan": "fp32_tiles"}
    ours = run(torch.compile(fn, backend="chunked_logits", options=options), inputs, (0, 1))
    assert_no_less_accurate(ours, stock, ref, torch.bfloat16, 2e-6, 2**-8)
