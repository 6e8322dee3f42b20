// Portable path: plain C++ compiled with the baseline flags; also the reference the SIMD paths are tested
// against through the same template.
#include <type_traits>

#include "kernels.h"

namespace killick {
namespace {
#include "kernel_impl.h"

template <class WEIGHT>
struct Scalar {
  using WT = WEIGHT;
  using XT = float;
  using WV = float;
  using XV = float;
  using R = float;
  static constexpr int W = 1;
  static constexpr int NACC = 8;
  static R zero() { return 0.f; }
  static WV load_w(const WT* p) { return w_scalar(p); }
  static XV load_x(const XT* p) { return *p; }
  static R fma(R a, WV w, XV x) { return a + w * x; }
  static R add(R a, R b) { return a + b; }
  static float hsum(R a) { return a; }
  static float w_scalar(const float* p) { return *p; }
  static float w_scalar(const uint16_t* p) { return bf16_to_f32(*p); }
  static float x_scalar(const XT* p) { return *p; }
};

uint64_t read_scalar(const void* p, size_t nbytes) {
  const uint64_t* q = static_cast<const uint64_t*>(p);
  uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0;
  size_t n = nbytes / 8, i = 0;
  for (; i + 4 <= n; i += 4) { a0 ^= q[i]; a1 ^= q[i + 1]; a2 ^= q[i + 2]; a3 ^= q[i + 3]; }
  for (; i < n; ++i) a0 ^= q[i];
  return a0 ^ a1 ^ a2 ^ a3;
}

struct ReadScalar {
  using V = uint64_t;
  static constexpr int BYTES = 8;
  static V zero() { return 0; }
  static V load(const char* p) {
    uint64_t w;
    __builtin_memcpy(&w, p, 8);
    return w;
  }
  static V mix(V a, V b) { return a ^ b; }
  static uint64_t fold(V a) { return a; }
};

// The tile path's reference (DotTileFn): the same packed activations, one product at a time. Only used where
// a caller asks for tiles on this table (tests of the tile-mode job on machines without tile hardware).
void dot_tiles_ref(int S, const void* const* W, int64_t ld, int K, int rows, const uint32_t* xp, int T,
                   float* const* out, int os, int) {
  for (int s = 0; s < S; ++s)
    for (int r = 0; r < rows; ++r) {
      const uint16_t* w = static_cast<const uint16_t*>(W[s]) + r * ld;
      for (int t = 0; t < T; ++t) {
        float acc = 0.f;
        for (int p = 0; p < K / 2; ++p) {
          const uint32_t v = xp[p * T + t];
          acc += bf16_to_f32(w[2 * p]) * bf16_to_f32(uint16_t(v & 0xffffu)) +
                 bf16_to_f32(w[2 * p + 1]) * bf16_to_f32(uint16_t(v >> 16));
        }
        out[s][t * os + r] = acc;
      }
    }
}

const KernelTable kTable = {"scalar", {dot_rows<Scalar<float>>, dot_rows<Scalar<uint16_t>>},
                            {dot_streams<Scalar<float>>, dot_streams<Scalar<uint16_t>>}, {false, false},
                            read_streams<ReadScalar, read_scalar>, dot_tiles_ref};
}  // namespace

const KernelTable* table_scalar() { return &kTable; }
}  // namespace killick
