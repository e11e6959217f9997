"""Every norm, rope and elementwise wrapper recorded ahead of time on the ``meta`` device, as the build does.

Each wrapper launches one kernel rendered for its sizes (literals in the source, no constexpr arguments left but
the PDL switch), once per specialisation, on a grid of its sizes, with tensors and numbers only, and returns
outputs of the right shapes on ``meta``.
"""

from __future__ import annotations

import torch

from mxc.kernels.triton_elementwise import add, embedding, silu_mul
from mxc.kernels.triton_norm import add_rms_norm, rms_norm
from mxc.kernels.triton_rope import rope_qkv_write, rope_tables
from tests.kernels.kernel_checks import EPS, meta, record, rendered, rope_spec
from tests.kernels.kernel_checks import on_device  # noqa: F401 (autouse fixture)


def test_wrappers_record_one_launch_on_meta():
    """Each wrapper launches one kernel rendered for its sizes (literals in the source, no constexpr
    arguments left but the PDL switch) with tensors and numbers only."""
    x, w = meta(5, 100), meta(100)
    out, kernel, grid, cx = record(lambda: rms_norm(x, w, EPS))
    assert (kernel.fn.__name__, grid, cx) == ("rms_norm_kernel", (5,), {})
    assert "H: tl.constexpr = 100" in rendered(kernel) and "residual_ptr" not in rendered(kernel)
    assert out.device.type == "meta" and out.shape == (5, 100)

    (new_r, out), fused, grid, cx = record(lambda: add_rms_norm(x, meta(5, 100), w, EPS))
    assert (fused.fn.__name__, grid, cx) == ("rms_norm_kernel", (5,), {}) and fused is not kernel
    assert "residual_ptr" in rendered(fused)
    assert new_r.shape == out.shape == (5, 100)

    _, head_norm, grid, cx = record(lambda: rms_norm(meta(5, 6, 24), meta(24), EPS))  # per-head q/k norm
    assert grid == (30,) and "H: tl.constexpr = 24\n    BLOCK_H: tl.constexpr = 32" in rendered(head_norm)
    assert record(lambda: rms_norm(x, w, EPS))[1] is kernel  # rendered once per specialisation

    spec = rope_spec("llama3", 48, partial=True)
    cos, sin = rope_tables(spec, 64, "meta")
    assert cos.device.type == "meta" and cos.shape == (64, 12)
    for qk_norm in (None, "head", "whole"):
        qn, kn = {None: (None, None), "head": (meta(48), meta(48)), "whole": (meta(6 * 48), meta(2 * 48))}[qk_norm]
        q, kernel, grid, cx = record(lambda: rope_qkv_write(
            meta(5, (6 + 2 * 2) * 48), meta(5, dtype=torch.int64), cos, sin, meta(3, 8, 2, 48),
            meta(3, 8, 2, 48), meta(5, dtype=torch.int64), qn, kn, EPS))
        # one program per token and kv group; per token when the norm spans all its heads
        assert (kernel.fn.__name__, grid, cx) == ("rope_qkv_write_kernel", (5,) if qk_norm == "whole" else (5, 2), {})
        src = rendered(kernel)
        assert "HQ: tl.constexpr = 6" in src and "R: tl.constexpr = 24" in src
        assert ("GROUP: tl.constexpr = 3" in src and "BLOCK_G: tl.constexpr = 4" in src) == (qk_norm != "whole")
        assert ("q_norm_ptr" in src) == (qk_norm is not None)
        assert q.shape == (5, 6, 48)
    for qk_norm in (None, "head"):  # prefill's token counts: one program per token
        qn, kn = (meta(48), meta(48)) if qk_norm else (None, None)
        q, kernel, grid, cx = record(lambda: rope_qkv_write(
            meta(40, (6 + 2 * 2) * 48), meta(40, dtype=torch.int64), cos, sin, meta(3, 64, 2, 48),
            meta(3, 64, 2, 48), meta(40, dtype=torch.int64), qn, kn, EPS))
        assert grid == (40,) and "BLOCK_HQ: tl.constexpr = 8" in rendered(kernel)

    out, kernel, grid, cx = record(lambda: silu_mul(meta(5, 2 * 1100)))
    assert (kernel.fn.__name__, grid, cx) == ("silu_mul_kernel", (5, 2), {})
    assert "I: tl.constexpr = 1100\n    BLOCK_N: tl.constexpr = 1024" in rendered(kernel)
    assert out.shape == (5, 1100)

    out, kernel, grid, cx = record(lambda: embedding(meta(5, dtype=torch.int64), meta(256, 100)))
    assert (kernel.fn.__name__, grid) == ("embedding_kernel", (5, 1)) and "H: tl.constexpr = 100" in rendered(kernel)
    assert out.shape == (5, 100)

    out, kernel, grid, cx = record(lambda: add(meta(5, 100), meta(5, 100)))
    assert (kernel.fn.__name__, grid) == ("add_kernel", (5, 1)) and "N: tl.constexpr = 100" in rendered(kernel)
    assert out.shape == (5, 100)
