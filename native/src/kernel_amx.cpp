// AMX path: the AVX-512-BF16 kernels plus AMX-BF16 tiles for experts with several tokens (compiled with
// -mamx-tile -mamx-bf16 besides -mavx512bf16).
#define KILLICK_BF16_DOT 1
#define KILLICK_AMX 1
#include "kernel_avx512.cpp"
