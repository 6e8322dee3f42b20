// AVX-512 (F + BW) path: bf16 weights widened to fp32 in registers, fp32 activations.
// With -DKILLICK_BF16_DOT (kernel_avx512bf16.cpp) the bf16 table uses VDPBF16PS on bf16 activations; with
// -DKILLICK_AMX as well (kernel_amx.cpp) it also has the AMX tile path.
#include <immintrin.h>

#include <type_traits>

#include "kernels.h"

namespace killick {
namespace {
#include "kernel_impl.h"

// (GCC 12's _mm512_reduce_add_ps trips -Wuninitialized inside its own header.)
inline float hsum512(__m512 a) {
  __m512 s = _mm512_add_ps(a, _mm512_shuffle_f32x4(a, a, 0x4E));
  s = _mm512_add_ps(s, _mm512_shuffle_f32x4(s, s, 0xB1));
  __m128 q = _mm512_castps512_ps128(s);
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_movehdup_ps(q));
  return _mm_cvtss_f32(q);
}

template <class WEIGHT>
struct Avx512 {
  using WT = WEIGHT;
  using XT = float;
  using WV = __m512;
  using XV = __m512;
  using R = __m512;
  static constexpr int W = 16;
  static constexpr int NACC = 16;  // 32 zmm registers
  static R zero() { return _mm512_setzero_ps(); }
  static WV load_w(const float* p) { return _mm512_loadu_ps(p); }
  static WV load_w(const uint16_t* p) {
    __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  }
  static XV load_x(const float* p) { return _mm512_loadu_ps(p); }
  static R fma(R a, WV w, XV x) { return _mm512_fmadd_ps(w, x, a); }
  static R add(R a, R b) { return _mm512_add_ps(a, b); }
  static float hsum(R a) { return hsum512(a); }
  static float w_scalar(const float* p) { return *p; }
  static float w_scalar(const uint16_t* p) { return bf16_to_f32(*p); }
  static float x_scalar(const float* p) { return *p; }
};

#ifdef KILLICK_BF16_DOT
// Both operands bf16, pairs of products summed into fp32 lanes (VDPBF16PS).
struct Avx512Dp {
  using WT = uint16_t;
  using XT = uint16_t;
  using WV = __m512bh;
  using XV = __m512bh;
  using R = __m512;
  static constexpr int W = 32;
  static constexpr int NACC = 16;
  static R zero() { return _mm512_setzero_ps(); }
  static WV load_w(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static XV load_x(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static R fma(R a, WV w, XV x) { return _mm512_dpbf16_ps(a, w, x); }
  static R add(R a, R b) { return _mm512_add_ps(a, b); }
  static float hsum(R a) { return hsum512(a); }
  static float w_scalar(const uint16_t* p) { return bf16_to_f32(*p); }
  static float x_scalar(const uint16_t* p) { return bf16_to_f32(*p); }
};
#endif

uint64_t read_avx512(const void* p, size_t nbytes) {
  const char* c = static_cast<const char*>(p);
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  size_t i = 0;
  for (; i + 256 <= nbytes; i += 256) {
    a0 = _mm512_xor_si512(a0, _mm512_loadu_si512(c + i));
    a1 = _mm512_xor_si512(a1, _mm512_loadu_si512(c + i + 64));
    a2 = _mm512_xor_si512(a2, _mm512_loadu_si512(c + i + 128));
    a3 = _mm512_xor_si512(a3, _mm512_loadu_si512(c + i + 192));
  }
  __m512i a = _mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3));
  alignas(64) uint64_t lanes[8];
  _mm512_store_si512(lanes, a);
  uint64_t out = 0;
  for (int l = 0; l < 8; ++l) out ^= lanes[l];
  for (; i + 8 <= nbytes; i += 8) {
    uint64_t w;
    __builtin_memcpy(&w, c + i, 8);
    out ^= w;
  }
  return out;
}

struct ReadAvx512 {
  using V = __m512i;
  static constexpr int BYTES = 64;
  static V zero() { return _mm512_setzero_si512(); }
  static V load(const char* p) { return _mm512_loadu_si512(p); }
  static V mix(V a, V b) { return _mm512_xor_si512(a, b); }
  static uint64_t fold(V a) {
    alignas(64) uint64_t lanes[8];
    _mm512_store_si512(lanes, a);
    uint64_t out = 0;
    for (int l = 0; l < 8; ++l) out ^= lanes[l];
    return out;
  }
};

#ifdef KILLICK_AMX
// AMX tiles (DotTileFn): TDPBF16PS multiplies a tile of m weight rows x 32 bf16 (read in place, the rows ld
// apart) by a tile of 16 activation pairs x T tokens (xp) into m x T fp32 sums. Tiles 0 and 1 accumulate (the
// gate and the up rows, or one matrix's even and odd 32-column steps: two independent chains), 2 and 3 hold
// weights, 4 and 5 activations. The configuration is loaded at each call (another library may have used the
// tiles on this thread since) and released at its end.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline void configure_tiles(int m, int T) {
  TileConfig c;
  for (int i = 0; i < 2; ++i) {
    c.rows[i] = uint8_t(m);
    c.colsb[i] = uint16_t(T * 4);
    c.rows[2 + i] = uint8_t(m);
    c.colsb[2 + i] = 64;
    c.rows[4 + i] = 16;
    c.colsb[4 + i] = uint16_t(T * 4);
  }
  _tile_loadconfig(&c);
}

inline void prefetch_rows(const uint16_t* w, int64_t ld, int m, int pf) {
  for (int i = 0; i < m; ++i) _mm_prefetch(reinterpret_cast<const char*>(w + i * ld) + pf, _MM_HINT_T0);
}

void dot_tiles(int S, const void* const* W, int64_t ld, int K, int rows, const uint32_t* xp, int T,
               float* const* out, int os, int pf) {
  alignas(64) float c0[16 * 16], c1[16 * 16];
  const int64_t stride = ld * 2;  // bytes from one weight row to the next
  const int xs = T * 4;           // bytes from one activation pair row to the next
  int configured = 0;
  for (int r0 = 0; r0 < rows; r0 += 16) {
    const int m = rows - r0 < 16 ? rows - r0 : 16;
    if (m != configured) {
      configure_tiles(m, T);
      configured = m;
    }
    _tile_zero(0);
    _tile_zero(1);
    const uint16_t* a = static_cast<const uint16_t*>(W[0]) + r0 * ld;
    if (S == 2) {
      const uint16_t* b = static_cast<const uint16_t*>(W[1]) + r0 * ld;
      for (int k = 0; k < K; k += 32) {
        if (pf > 0) {
          prefetch_rows(a + k, ld, m, pf);
          prefetch_rows(b + k, ld, m, pf);
        }
        _tile_loadd(4, xp + (k / 2) * T, xs);
        _tile_loadd(2, a + k, stride);
        _tile_loadd(3, b + k, stride);
        _tile_dpbf16ps(0, 2, 4);
        _tile_dpbf16ps(1, 3, 4);
      }
    } else {
      int k = 0;
      for (; k + 64 <= K; k += 64) {
        if (pf > 0) prefetch_rows(a + k, ld, m, pf);  // one line of each row covers both steps
        _tile_loadd(4, xp + (k / 2) * T, xs);
        _tile_loadd(5, xp + (k / 2 + 16) * T, xs);
        _tile_loadd(2, a + k, stride);
        _tile_loadd(3, a + k + 32, stride);
        _tile_dpbf16ps(0, 2, 4);
        _tile_dpbf16ps(1, 3, 5);
      }
      if (k < K) {
        _tile_loadd(4, xp + (k / 2) * T, xs);
        _tile_loadd(2, a + k, stride);
        _tile_dpbf16ps(0, 2, 4);
      }
    }
    _tile_stored(0, c0, xs);
    _tile_stored(1, c1, xs);
    for (int i = 0; i < m; ++i)
      for (int t = 0; t < T; ++t) {
        if (S == 2) {
          out[0][t * os + r0 + i] = c0[i * T + t];
          out[1][t * os + r0 + i] = c1[i * T + t];
        } else {
          out[0][t * os + r0 + i] = c0[i * T + t] + c1[i * T + t];
        }
      }
  }
  _tile_release();
}
#endif

#if defined(KILLICK_AMX)
const KernelTable kTable = {"amx", {dot_rows<Avx512<float>>, dot_rows<Avx512Dp>},
                            {dot_streams<Avx512<float>>, dot_streams<Avx512Dp>}, {false, true},
                            read_streams<ReadAvx512, read_avx512>, dot_tiles};
#elif defined(KILLICK_BF16_DOT)
const KernelTable kTable = {"avx512bf16", {dot_rows<Avx512<float>>, dot_rows<Avx512Dp>},
                            {dot_streams<Avx512<float>>, dot_streams<Avx512Dp>}, {false, true},
                            read_streams<ReadAvx512, read_avx512>, nullptr};
#else
const KernelTable kTable = {"avx512", {dot_rows<Avx512<float>>, dot_rows<Avx512<uint16_t>>},
                            {dot_streams<Avx512<float>>, dot_streams<Avx512<uint16_t>>}, {false, false},
                            read_streams<ReadAvx512, read_avx512>, nullptr};
#endif
}  // namespace

#if defined(KILLICK_AMX)
const KernelTable* table_amx() { return &kTable; }
#elif defined(KILLICK_BF16_DOT)
const KernelTable* table_avx512bf16() { return &kTable; }
#else
const KernelTable* table_avx512() { return &kTable; }
#endif
}  // namespace killick
