// AVX-512-BF16 path: the AVX-512 unit with VDPBF16PS for bf16 weights (compiled with -mavx512bf16).
#define KILLICK_BF16_DOT 1
#include "kernel_avx512.cpp"
