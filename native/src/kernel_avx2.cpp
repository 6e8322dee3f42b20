// AVX2 + FMA path (compiled with -mavx2 -mfma; only called after a runtime CPU check).
#include <immintrin.h>

#include <type_traits>

#include "kernels.h"

namespace killick {
namespace {
#include "kernel_impl.h"

inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// fp32 weights against fp32 activations.
struct Avx2 {
  using WT = float;
  using XT = float;
  using WV = __m256;
  using XV = __m256;
  using R = __m256;
  static constexpr int W = 8;
  static constexpr int NACC = 8;  // 16 ymm registers: 8 accumulators + weights + one activation
  static R zero() { return _mm256_setzero_ps(); }
  static WV load_w(const float* p) { return _mm256_loadu_ps(p); }
  static XV load_x(const float* p) { return _mm256_loadu_ps(p); }
  static R fma(R a, WV w, XV x) { return _mm256_fmadd_ps(w, x, a); }
  static R add(R a, R b) { return _mm256_add_ps(a, b); }
  static float hsum(R a) { return hsum256(a); }
  static float w_scalar(const float* p) { return *p; }
  static float x_scalar(const float* p) { return *p; }
};

// bf16 weights against bf16 activations: one 32-byte load of each brings 16 elements, split in registers into
// the even elements (shifted up: bf16 -> fp32 is a 16-bit shift) and the odd ones (masked in place), each pair
// of halves into its own fp32 accumulator. Half the loads per weight line of widening 8 weights at a time
// against fp32 activations: on Zen 3 the load count, not the arithmetic, held a core below its read rate
// (one contiguous stream, 1 core: 0.78 -> 0.86 of the read kernel; docs/PERF.md, "native CPU expert kernels").
struct Pair {
  __m256 even, odd;
};
struct Avx2Bf {
  using WT = uint16_t;
  using XT = uint16_t;
  using WV = __m256i;
  using XV = __m256i;
  using R = Pair;
  static constexpr int W = 16;
  static constexpr int NACC = 6;  // accumulator pairs: 12 of the 16 ymm registers
  static R zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static WV load_w(const uint16_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static XV load_x(const uint16_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static __m256 even(__m256i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
  static __m256 odd(__m256i v) {
    return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(int(0xFFFF0000u))));
  }
  static R fma(R a, WV w, XV x) {
    return {_mm256_fmadd_ps(even(w), even(x), a.even), _mm256_fmadd_ps(odd(w), odd(x), a.odd)};
  }
  static R add(R a, R b) { return {_mm256_add_ps(a.even, b.even), _mm256_add_ps(a.odd, b.odd)}; }
  static float hsum(R a) { return hsum256(_mm256_add_ps(a.even, a.odd)); }
  static float w_scalar(const uint16_t* p) { return bf16_to_f32(*p); }
  static float x_scalar(const uint16_t* p) { return bf16_to_f32(*p); }
};

uint64_t read_avx2(const void* p, size_t nbytes) {
  const char* c = static_cast<const char*>(p);
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  size_t i = 0;
  for (; i + 128 <= nbytes; i += 128) {
    a0 = _mm256_xor_si256(a0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + i)));
    a1 = _mm256_xor_si256(a1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + i + 32)));
    a2 = _mm256_xor_si256(a2, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + i + 64)));
    a3 = _mm256_xor_si256(a3, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + i + 96)));
  }
  __m256i a = _mm256_xor_si256(_mm256_xor_si256(a0, a1), _mm256_xor_si256(a2, a3));
  uint64_t out = uint64_t(_mm256_extract_epi64(a, 0)) ^ uint64_t(_mm256_extract_epi64(a, 1)) ^
                 uint64_t(_mm256_extract_epi64(a, 2)) ^ uint64_t(_mm256_extract_epi64(a, 3));
  for (; i + 8 <= nbytes; i += 8) {
    uint64_t w;
    __builtin_memcpy(&w, c + i, 8);
    out ^= w;
  }
  return out;
}

struct ReadAvx2 {
  using V = __m256i;
  static constexpr int BYTES = 32;
  static V zero() { return _mm256_setzero_si256(); }
  static V load(const char* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static V mix(V a, V b) { return _mm256_xor_si256(a, b); }
  static uint64_t fold(V a) {
    return uint64_t(_mm256_extract_epi64(a, 0)) ^ uint64_t(_mm256_extract_epi64(a, 1)) ^
           uint64_t(_mm256_extract_epi64(a, 2)) ^ uint64_t(_mm256_extract_epi64(a, 3));
  }
};

const KernelTable kTable = {"avx2", {dot_rows<Avx2>, dot_rows<Avx2Bf>}, {dot_streams<Avx2>, dot_streams<Avx2Bf>},
                            {false, true}, read_streams<ReadAvx2, read_avx2>, nullptr};
}  // namespace

const KernelTable* table_avx2() { return &kTable; }
}  // namespace killick
