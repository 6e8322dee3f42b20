// AVX2 + FMA path (compiled with -mavx2 -mfma; only called after a runtime CPU check).
#include <immintrin.h>

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

template <class WEIGHT>
struct Avx2 {
  using WT = WEIGHT;
  using XT = float;
  using WV = __m256;
  using XV = __m256;
  using R = __m256;
  static constexpr int W = 8;
  static constexpr int NACC = 8;  // 16 ymm registers: 8 accumulators + weights + one activation
  static R zero() { return _mm256_setzero_ps(); }
  static WV load_w(const float* p) { return _mm256_loadu_ps(p); }
  static WV load_w(const uint16_t* p) {
    __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  }
  static XV load_x(const float* p) { return _mm256_loadu_ps(p); }
  static R fma(R a, WV w, XV x) { return _mm256_fmadd_ps(w, x, a); }
  static float hsum(R a) { return hsum256(a); }
  static float w_scalar(const float* p) { return *p; }
  static float w_scalar(const uint16_t* p) { return bf16_to_f32(*p); }
  static float x_scalar(const float* p) { return *p; }
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

const KernelTable kTable = {"avx2", {dot_rows<Avx2<float>>, dot_rows<Avx2<uint16_t>>},
                            {false, false}, read_avx2};
}  // namespace

const KernelTable* table_avx2() { return &kTable; }
}  // namespace killick
