"""The wrappers' host arithmetic (``launch.cdiv``, ``launch.next_pow2``) gives Triton's values without its call cost."""

import triton

from mxc.kernels.launch import cdiv, next_pow2


def test_next_pow2_equals_triton_s():
    assert [next_pow2(n) for n in range(0, 5000)] == [triton.next_power_of_2(n) for n in range(0, 5000)]
    assert next_pow2(2**40 + 1) == 2**41


def test_cdiv_equals_triton_s():
    pairs = [(a, b) for a in range(0, 300) for b in range(1, 40)] + [(2**40 + 3, 128)]
    assert [cdiv(a, b) for a, b in pairs] == [triton.cdiv(a, b) for a, b in pairs]
