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
// `cont` (the next block of this call, ROWS rows on, or the first rows the caller walks next), and stops where
// cont is null. (Running on into the next row in memory would fetch rows this block is already reading, and
// leave the next block's rows to start cold: a third of each 1 KiB down-projection row.)
template <class V, int T, int ROWS, int LOC>
inline void dot_block(const typename V::WT* w, int64_t ld, int K, const typename V::XT* const* x,
                      float* out, int os, int pf, const typename V::WT* cont) {
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
        else if (cont)
          __builtin_prefetch(reinterpret_cast<const char*>(cont + r * ld) + (off - row_bytes), 0, LOC);
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

// S row streams side by side (S = 2 or 4), one row of each at a time: row r of W[s] against x[s] into out[s]
// (an expert's gate and up rows, halves of them, or several experts' down rows), one line of each a step. On
// Zen 3 a core keeps more lines in flight over several long sequential streams than over one (the hardware
// prefetcher runs ahead on each): a contiguous microbenchmark read 1.08x / 1.17x the single-stream read rate
// with 2 / 4 streams, against 0.84x walking one row at a time.
template <class V, int S, int T, int LOC>
inline void dot_streams_row(const typename V::WT* const* w, int K, const typename V::XT* const* const* x,
                            float* const* out, int os, int pf) {
  constexpr int LINE = 64 / int(sizeof(typename V::WT));
  constexpr int J = LINE / V::W > 0 ? LINE / V::W : 1;
  constexpr int STEP = J * V::W;                   // one line of each stream
  constexpr int A = S * J * T <= V::NACC ? J : 1;  // accumulator sets per stream and token
  typename V::R acc[S][A][T];
  for (int s = 0; s < S; ++s)
    for (int u = 0; u < A; ++u)
      for (int t = 0; t < T; ++t) acc[s][u][t] = V::zero();
  int k = 0;
  for (; k + STEP <= K; k += STEP) {
    if (pf > 0)
      for (int s = 0; s < S; ++s) __builtin_prefetch(reinterpret_cast<const char*>(w[s] + k) + pf, 0, LOC);
    for (int j = 0; j < J; ++j)
      for (int s = 0; s < S; ++s) {
        typename V::WV v = V::load_w(w[s] + k + j * V::W);
        for (int t = 0; t < T; ++t) acc[s][j % A][t] = V::fma(acc[s][j % A][t], v, V::load_x(x[s][t] + k + j * V::W));
      }
  }
  for (; k + V::W <= K; k += V::W)
    for (int s = 0; s < S; ++s) {
      typename V::WV v = V::load_w(w[s] + k);
      for (int t = 0; t < T; ++t) acc[s][0][t] = V::fma(acc[s][0][t], v, V::load_x(x[s][t] + k));
    }
  for (int s = 0; s < S; ++s)
    for (int t = 0; t < T; ++t) {
      typename V::R sum = acc[s][0][t];
      for (int u = 1; u < A; ++u) sum = V::add(sum, acc[s][u][t]);
      float f = V::hsum(sum);
      for (int kk = k; kk < K; ++kk) f += V::w_scalar(w[s] + kk) * V::x_scalar(x[s][t] + kk);
      out[s][t * os] = f;
    }
}

template <class V, int S, int T, int LOC>
inline void dot_streams_t(const void* const* wp, int64_t ld, int K, int rows, const void* const* const* xp,
                          float* const* outp, int os, int pf) {
  const typename V::WT* w[S];
  const typename V::XT* const* x[S];
  float* out[S];
  for (int s = 0; s < S; ++s) x[s] = reinterpret_cast<const typename V::XT* const*>(xp[s]);
  for (int r = 0; r < rows; ++r) {
    for (int s = 0; s < S; ++s) {
      w[s] = static_cast<const typename V::WT*>(wp[s]) + r * ld;
      out[s] = outp[s] + r;
    }
    dot_streams_row<V, S, T, LOC>(w, K, x, out, os, pf);
  }
}

// then: the rows the caller walks after these (same ld, at least a block of them), or null; the last block's
// prefetches run on into them.
template <class V, int T, int LOC>
inline void dot_rows_t(const typename V::WT* w, int64_t ld, int K, int rows,
                       const typename V::XT* const* x, float* out, int os, int pf, int row_block,
                       const typename V::WT* then) {
  if (row_block == 1) {
    for (int r = 0; r < rows; ++r) dot_stream<V, T, LOC>(w + r * ld, K, x, out + r, os, pf);
    return;
  }
  constexpr int R = rows_per_block<T, V::NACC>();
  int r = 0;
  for (; r + R <= rows; r += R)
    dot_block<V, T, R, LOC>(w + r * ld, ld, K, x, out + r, os, pf,
                            r + 2 * R <= rows ? w + (r + R) * ld : (r + R == rows ? then : nullptr));
  for (; r < rows; ++r)
    dot_block<V, T, 1, LOC>(w + r * ld, ld, K, x, out + r, os, pf,
                            r + 2 <= rows ? w + (r + 1) * ld : (r + 1 == rows ? then : nullptr));
}

template <class V, int LOC>
void dot_rows_loc(const void* wp, int64_t ld, int K, int rows, const void* const* xp, int T, float* out,
                  int os, int pf, int rb, const void* thenp) {
  auto w = static_cast<const typename V::WT*>(wp);
  auto then = static_cast<const typename V::WT*>(thenp);
  auto x = reinterpret_cast<const typename V::XT* const*>(xp);
  switch (T) {
    case 1: dot_rows_t<V, 1, LOC>(w, ld, K, rows, x, out, os, pf, rb, then); break;
    case 2: dot_rows_t<V, 2, LOC>(w, ld, K, rows, x, out, os, pf, rb, then); break;
    case 3: dot_rows_t<V, 3, LOC>(w, ld, K, rows, x, out, os, pf, rb, then); break;
    default: dot_rows_t<V, 4, LOC>(w, ld, K, rows, x, out, os, pf, rb, then); break;
  }
}

template <class V, int LOC>
void dot_streams_loc(int S, const void* const* w, int64_t ld, int K, int rows, const void* const* const* x, int T,
                     float* const* out, int os, int pf) {
  if (T <= 2 && (S == 2 || S == 4)) {
    if (S == 2)
      T == 1 ? dot_streams_t<V, 2, 1, LOC>(w, ld, K, rows, x, out, os, pf)
             : dot_streams_t<V, 2, 2, LOC>(w, ld, K, rows, x, out, os, pf);
    else
      T == 1 ? dot_streams_t<V, 4, 1, LOC>(w, ld, K, rows, x, out, os, pf)
             : dot_streams_t<V, 4, 2, LOC>(w, ld, K, rows, x, out, os, pf);
    return;
  }
  // 3-4 tokens: accumulators for several streams would spill; one stream after the other
  for (int s = 0; s < S; ++s) dot_rows_loc<V, LOC>(w[s], ld, K, rows, x[s], T, out[s], os, pf, 1, nullptr);
}

// Calls f(std::integral_constant<int, L>) with L the prefetch locality for pf_hint: __builtin_prefetch's
// (3: prefetcht0, into L1; 2: t1, L2; 1: t2; 0: prefetchnta), which must be a compile-time constant.
template <class F>
void with_locality(int pf_hint, F&& f) {
  switch (pf_hint) {
    case 0: f(std::integral_constant<int, 0>{}); break;
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    default: f(std::integral_constant<int, 3>{}); break;
  }
}

template <class V>
void dot_streams(int S, const void* const* w, int64_t ld, int K, int rows, const void* const* const* x, int T,
                 float* const* out, int os, int pf, int pf_hint) {
  with_locality(pf_hint, [&](auto loc) {
    dot_streams_loc<V, decltype(loc)::value>(S, w, ld, K, rows, x, T, out, os, pf);
  });
}

// A read pass over S equal parts of [p, p + nbytes) side by side, one line of each a step (the tail that does
// not divide evenly read after): keeps the hardware prefetcher running on several streams per core. RV
// supplies V (a vector), BYTES (its size), zero(), load(const char*), mix(V, V) and fold(V) -> uint64_t.
template <class RV, int S>
uint64_t read_parts(const char* c, size_t nbytes) {
  typename RV::V acc[S][64 / RV::BYTES];
  for (int s = 0; s < S; ++s)
    for (int j = 0; j < 64 / RV::BYTES; ++j) acc[s][j] = RV::zero();
  size_t part = nbytes / S / 64 * 64;
  for (size_t i = 0; i < part; i += 64)
    for (int s = 0; s < S; ++s)
      for (int j = 0; j < 64 / RV::BYTES; ++j)
        acc[s][j] = RV::mix(acc[s][j], RV::load(c + s * part + i + j * RV::BYTES));
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

// The table's ReadFn: ONE (the ISA's own sequential loop, the STREAM-style read) for one stream, read_parts
// for 2 or 4.
template <class RV, uint64_t (*ONE)(const void*, size_t)>
uint64_t read_streams(const void* p, size_t nbytes, int streams) {
  const char* c = static_cast<const char*>(p);
  switch (streams) {
    case 1: return ONE(p, nbytes);
    case 2: return read_parts<RV, 2>(c, nbytes);
    default: return read_parts<RV, 4>(c, nbytes);
  }
}

template <class V>
void dot_rows(const void* w, int64_t ld, int K, int rows, const void* const* x, int T, float* out, int os,
              int pf, int pf_hint, int rb, const void* then) {
  with_locality(pf_hint, [&](auto loc) {
    dot_rows_loc<V, decltype(loc)::value>(w, ld, K, rows, x, T, out, os, pf, rb, then);
  });
}

inline float bf16_to_f32(uint16_t v) {
  uint32_t bits = uint32_t(v) << 16;
  float f;
  __builtin_memcpy(&f, &bits, 4);
  return f;
}
