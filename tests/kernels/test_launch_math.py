"""The host's launch arithmetic (engine/kernels/launch.py) gives triton.cdiv's and triton.next_power_of_2's values,
which grids and block sizes were made with before."""
import triton

from engine.kernels.launch import cdiv, next_pow2


def test_cdiv_and_next_pow2_match_triton_on_every_size_a_launch_meets():
    sizes = list(range(0, 4100)) + [2 ** k + d for k in range(12, 33) for d in (-1, 0, 1)]
    for n in sizes:
        assert next_pow2(n) == triton.next_power_of_2(n), n
        for b in (1, 3, 16, 64, 128, 1024):
            assert cdiv(n, b) == triton.cdiv(n, b), (n, b)
