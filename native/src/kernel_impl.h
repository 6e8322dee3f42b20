// Row-dot kernel template, included by each ISA translation unit inside its own anonymous namespace
// (internal linkage: no symbol compiled with wide instructions can leak into the generic code).
//
// A trait V supplies:  WT (weight element), XT (activation element), WV / XV / R (vector types),
//   W (weight elements per vector), NACC (accumulators the register file holds),
//   zero(), load_w(const WT*), load_x(const XT*), fma(R, WV, XV), hsum(R), w_scalar(), x_scalar().
//
// Shapes: W rows [rows, K] with row stride ld; x[t] a K-vector for t < T; out[t * os + r].
// The loop walks one 64-byte line of each of ROWS rows per step: ROWS independent streams, every weight
// vector loaded once and reused for all T tokens, one software prefetch per row and line.

template <int T, int NACC>
constexpr int rows_per_block() {
  return NACC / T >= 4 ? 4 : (NACC / T >= 2 ? 2 : 1);
}

// Each row's prefetch runs pf bytes ahead of its loads; past the row's end it continues into the same row of
// the next block (ROWS rows on) when `next` says that block is part of this call, and stops otherwise. (Running
// on into the next row in memory would fetch rows this block is already reading, and leave the next block's
// rows to start cold: a third of each 1 KiB down-projection row.)
template <class V, int T, int ROWS, int LOC>
inline void dot_block(const typename V::WT* w, int64_t ld, int K, const typename V::XT* const* x,
                      float* out, int os, int pf, bool next) {
  using WT = typename V::WT;
  constexpr int LINE = 64 / int(sizeof(WT));
  constexpr int J = LINE / V::W > 0 ? LINE / V::W : 1;
  typename V::R acc[ROWS][T];
  for (int r = 0; r < ROWS; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = V::zero();
  int k = 0;
  for (; k + J * V::W <= K; k += J * V::W) {
    if (pf > 0) {
      const int64_t off = int64_t(k) * int64_t(sizeof(WT)) + pf;  // bytes from the row's start
      const int64_t row_bytes = int64_t(K) * int64_t(sizeof(WT));
      for (int r = 0; r < ROWS; ++r) {
        const char* row = reinterpret_cast<const char*>(w + r * ld);
        if (off < row_bytes)
          __builtin_prefetch(row + off, 0, LOC);
        else if (next)
          __builtin_prefetch(row + ROWS * ld * int64_t(sizeof(WT)) + (off - row_bytes), 0, LOC);
      }
    }
    for (int j = 0; j < J; ++j) {
      typename V::WV wv[ROWS];
      for (int r = 0; r < ROWS; ++r) wv[r] = V::load_w(w + r * ld + k + j * V::W);
      for (int t = 0; t < T; ++t) {
        typename V::XV xv = V::load_x(x[t] + k + j * V::W);
        for (int r = 0; r < ROWS; ++r) acc[r][t] = V::fma(acc[r][t], wv[r], xv);
      }
    }
  }
  for (; k + V::W <= K; k += V::W) {
    for (int t = 0; t < T; ++t) {
      typename V::XV xv = V::load_x(x[t] + k);
      for (int r = 0; r < ROWS; ++r) acc[r][t] = V::fma(acc[r][t], V::load_w(w + r * ld + k), xv);
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    for (int t = 0; t < T; ++t) {
      float s = V::hsum(acc[r][t]);
      for (int kk = k; kk < K; ++kk) s += V::w_scalar(w + r * ld + kk) * V::x_scalar(x[t] + kk);
      out[t * os + r] = s;
    }
  }
}

// One row, one sequential stream, two lines a step; A independent accumulator sets (every vector of a step
// has its own while registers allow), so no FMA latency chain runs through a step.
template <class V, int T, int LOC>
inline void dot_stream(const typename V::WT* w, int K, const typename V::XT* const* x, float* out, int os,
                            int pf) {
  constexpr int LINE = 64 / int(sizeof(typename V::WT));
  constexpr int J = LINE / V::W > 0 ? LINE / V::W : 1;
  constexpr int STEP = 2 * J * V::W;  // two lines
  constexpr int NV = 2 * J;           // vectors per step
  constexpr int A0 = (V::NACC - 2) / T;
  constexpr int A = A0 >= NV ? NV : (A0 >= 4 && NV % 4 == 0 ? 4 : (A0 >= 2 ? 2 : 1));
  typename V::R acc[A][T];
  for (int u = 0; u < A; ++u)
    for (int t = 0; t < T; ++t) acc[u][t] = V::zero();
  int k = 0;
  for (; k + STEP <= K; k += STEP) {
    if (pf > 0) __builtin_prefetch(reinterpret_cast<const char*>(w + k) + pf, 0, LOC);
    if (pf > 0) __builtin_prefetch(reinterpret_cast<const char*>(w + k) + pf + 64, 0, LOC);
    for (int v = 0; v < NV; ++v) {
      typename V::WV wv = V::load_w(w + k + v * V::W);
      for (int t = 0; t < T; ++t) acc[v % A][t] = V::fma(acc[v % A][t], wv, V::load_x(x[t] + k + v * V::W));
    }
  }
  for (; k + V::W <= K; k += V::W) {
    typename V::WV wv = V::load_w(w + k);
    for (int t = 0; t < T; ++t) acc[0][t] = V::fma(acc[0][t], wv, V::load_x(x[t] + k));
  }
  for (int t = 0; t < T; ++t) {
    typename V::R s = acc[0][t];
    for (int u = 1; u < A; ++u) s = V::add(s, acc[u][t]);
    float f = V::hsum(s);
    for (int kk = k; kk < K; ++kk) f += V::w_scalar(w + kk) * V::x_scalar(x[t] + kk);
    out[t * os] = f;
  }
}

// Two row streams side by side, one row of each at a time: row r of W1 against x1 and row r of W2 against x2
// (an expert's gate and up rows, or two experts' down rows), one line of each a step. On Zen 3 two long
// sequential streams keep more lines in flight than one (the hardware prefetcher runs ahead on each): one
// core read 1.06x its single-stream read rate this way, against 0.84x walking one row at a time.
template <class V, int T, int LOC>
inline void dot_pair_row(const typename V::WT* w1, const typename V::WT* w2, int K, const typename V::XT* const* x1,
                         const typename V::XT* const* x2, float* out1, float* out2, int os, int pf) {
  constexpr int LINE = 64 / int(sizeof(typename V::WT));
  constexpr int J = LINE / V::W > 0 ? LINE / V::W : 1;
  constexpr int STEP = J * V::W;  // one line of each stream
  typename V::R a1[J][T], a2[J][T];
  for (int j = 0; j < J; ++j)
    for (int t = 0; t < T; ++t) a1[j][t] = a2[j][t] = V::zero();
  int k = 0;
  for (; k + STEP <= K; k += STEP) {
    if (pf > 0) {
      __builtin_prefetch(reinterpret_cast<const char*>(w1 + k) + pf, 0, LOC);
      __builtin_prefetch(reinterpret_cast<const char*>(w2 + k) + pf, 0, LOC);
    }
    for (int j = 0; j < J; ++j) {
      typename V::WV v1 = V::load_w(w1 + k + j * V::W), v2 = V::load_w(w2 + k + j * V::W);
      for (int t = 0; t < T; ++t) {
        a1[j][t] = V::fma(a1[j][t], v1, V::load_x(x1[t] + k + j * V::W));
        a2[j][t] = V::fma(a2[j][t], v2, V::load_x(x2[t] + k + j * V::W));
      }
    }
  }
  for (; k + V::W <= K; k += V::W) {
    typename V::WV v1 = V::load_w(w1 + k), v2 = V::load_w(w2 + k);
    for (int t = 0; t < T; ++t) {
      a1[0][t] = V::fma(a1[0][t], v1, V::load_x(x1[t] + k));
      a2[0][t] = V::fma(a2[0][t], v2, V::load_x(x2[t] + k));
    }
  }
  for (int t = 0; t < T; ++t) {
    typename V::R s1 = a1[0][t], s2 = a2[0][t];
    for (int j = 1; j < J; ++j) s1 = V::add(s1, a1[j][t]), s2 = V::add(s2, a2[j][t]);
    float f1 = V::hsum(s1), f2 = V::hsum(s2);
    for (int kk = k; kk < K; ++kk) {
      f1 += V::w_scalar(w1 + kk) * V::x_scalar(x1[t] + kk);
      f2 += V::w_scalar(w2 + kk) * V::x_scalar(x2[t] + kk);
    }
    out1[t * os] = f1;
    out2[t * os] = f2;
  }
}

template <class V, int T, int LOC>
inline void dot_pair_t(const typename V::WT* w1, const typename V::WT* w2, int64_t ld, int K, int rows,
                       const typename V::XT* const* x1, const typename V::XT* const* x2, float* out1, float* out2,
                       int os, int pf) {
  for (int r = 0; r < rows; ++r)
    dot_pair_row<V, T, LOC>(w1 + r * ld, w2 + r * ld, K, x1, x2, out1 + r, out2 + r, os, pf);
}

template <class V, int T, int LOC>
inline void dot_rows_t(const typename V::WT* w, int64_t ld, int K, int rows,
                       const typename V::XT* const* x, float* out, int os, int pf, int row_block) {
  if (row_block == 1) {
    for (int r = 0; r < rows; ++r) dot_stream<V, T, LOC>(w + r * ld, K, x, out + r, os, pf);
    return;
  }
  constexpr int R = rows_per_block<T, V::NACC>();
  int r = 0;
  for (; r + R <= rows; r += R) dot_block<V, T, R, LOC>(w + r * ld, ld, K, x, out + r, os, pf, r + 2 * R <= rows);
  for (; r < rows; ++r) dot_block<V, T, 1, LOC>(w + r * ld, ld, K, x, out + r, os, pf, r + 2 <= rows);
}

template <class V, int LOC>
void dot_rows_loc(const void* wp, int64_t ld, int K, int rows, const void* const* xp, int T, float* out,
                  int os, int pf, int rb) {
  auto w = static_cast<const typename V::WT*>(wp);
  auto x = reinterpret_cast<const typename V::XT* const*>(xp);
  switch (T) {
    case 1: dot_rows_t<V, 1, LOC>(w, ld, K, rows, x, out, os, pf, rb); break;
    case 2: dot_rows_t<V, 2, LOC>(w, ld, K, rows, x, out, os, pf, rb); break;
    case 3: dot_rows_t<V, 3, LOC>(w, ld, K, rows, x, out, os, pf, rb); break;
    default: dot_rows_t<V, 4, LOC>(w, ld, K, rows, x, out, os, pf, rb); break;
  }
}

template <class V, int LOC>
void dot_pair_loc(const void* w1p, const void* w2p, int64_t ld, int K, int rows, const void* const* x1p,
                  const void* const* x2p, int T, float* out1, float* out2, int os, int pf) {
  auto w1 = static_cast<const typename V::WT*>(w1p);
  auto w2 = static_cast<const typename V::WT*>(w2p);
  auto x1 = reinterpret_cast<const typename V::XT* const*>(x1p);
  auto x2 = reinterpret_cast<const typename V::XT* const*>(x2p);
  switch (T) {
    case 1: dot_pair_t<V, 1, LOC>(w1, w2, ld, K, rows, x1, x2, out1, out2, os, pf); break;
    case 2: dot_pair_t<V, 2, LOC>(w1, w2, ld, K, rows, x1, x2, out1, out2, os, pf); break;
    default:  // 3-4 tokens: accumulators for two streams would spill; one stream after the other
      dot_rows_loc<V, LOC>(w1p, ld, K, rows, x1p, T, out1, os, pf, 1);
      dot_rows_loc<V, LOC>(w2p, ld, K, rows, x2p, T, out2, os, pf, 1);
  }
}

template <class V>
void dot_pair(const void* w1, const void* w2, int64_t ld, int K, int rows, const void* const* x1,
              const void* const* x2, int T, float* out1, float* out2, int os, int pf, int pf_hint) {
  switch (pf_hint) {
    case 0: dot_pair_loc<V, 0>(w1, w2, ld, K, rows, x1, x2, T, out1, out2, os, pf); break;
    case 1: dot_pair_loc<V, 1>(w1, w2, ld, K, rows, x1, x2, T, out1, out2, os, pf); break;
    case 2: dot_pair_loc<V, 2>(w1, w2, ld, K, rows, x1, x2, T, out1, out2, os, pf); break;
    default: dot_pair_loc<V, 3>(w1, w2, ld, K, rows, x1, x2, T, out1, out2, os, pf); break;
  }
}

// A read pass over `streams` equal parts of [p, p + nbytes) side by side, one line of each a step (the tail
// that does not divide evenly read after): the STREAM-style read with 1, and a read that keeps the hardware
// prefetcher running on several streams per core with more. RV supplies V (a vector), BYTES (its size),
// zero(), load(const char*), mix(V, V) and fold(V) -> uint64_t.
template <class RV, int S>
uint64_t read_parts(const char* c, size_t nbytes) {
  typename RV::V acc[S][64 / RV::BYTES];
  for (int s = 0; s < S; ++s)
    for (int j = 0; j < 64 / RV::BYTES; ++j) acc[s][j] = RV::zero();
  size_t part = nbytes / S / 64 * 64;
  for (size_t i = 0; i < part; i += 64)
    for (int s = 0; s < S; ++s)
      for (int j = 0; j < 64 / RV::BYTES; ++j) acc[s][j] = RV::mix(acc[s][j], RV::load(c + s * part + i + j * RV::BYTES));
  uint64_t out = 0;
  for (int s = 0; s < S; ++s)
    for (int j = 0; j < 64 / RV::BYTES; ++j) out ^= RV::fold(acc[s][j]);
  for (size_t i = S * part; i + 8 <= nbytes; i += 8) {
    uint64_t w;
    __builtin_memcpy(&w, c + i, 8);
    out ^= w;
  }
  return out;
}

template <class RV>
uint64_t read_streams(const void* p, size_t nbytes, int streams) {
  const char* c = static_cast<const char*>(p);
  switch (streams) {
    case 1: return read_parts<RV, 1>(c, nbytes);
    case 2: return read_parts<RV, 2>(c, nbytes);
    default: return read_parts<RV, 4>(c, nbytes);
  }
}

// pf_hint: __builtin_prefetch's locality (3: prefetcht0, into L1; 2: t1, L2; 1: t2; 0: prefetchnta).
template <class V>
void dot_rows(const void* w, int64_t ld, int K, int rows, const void* const* x, int T, float* out, int os,
              int pf, int pf_hint, int rb) {
  switch (pf_hint) {
    case 0: dot_rows_loc<V, 0>(w, ld, K, rows, x, T, out, os, pf, rb); break;
    case 1: dot_rows_loc<V, 1>(w, ld, K, rows, x, T, out, os, pf, rb); break;
    case 2: dot_rows_loc<V, 2>(w, ld, K, rows, x, T, out, os, pf, rb); break;
    default: dot_rows_loc<V, 3>(w, ld, K, rows, x, T, out, os, pf, rb); break;
  }
}

inline float bf16_to_f32(uint16_t v) {
  uint32_t bits = uint32_t(v) << 16;
  float f;
  __builtin_memcpy(&f, &bits, 4);
  return f;
}
