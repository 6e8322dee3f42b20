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

template <class V, int T, int ROWS>
inline void dot_block(const typename V::WT* w, int64_t ld, int K, const typename V::XT* const* x,
                      float* out, int os, int pf) {
  using WT = typename V::WT;
  constexpr int LINE = 64 / int(sizeof(WT));
  constexpr int J = LINE / V::W > 0 ? LINE / V::W : 1;
  typename V::R acc[ROWS][T];
  for (int r = 0; r < ROWS; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = V::zero();
  int k = 0;
  for (; k + J * V::W <= K; k += J * V::W) {
    if (pf > 0)
      for (int r = 0; r < ROWS; ++r)
        __builtin_prefetch(reinterpret_cast<const char*>(w + r * ld + k) + pf, 0, 3);
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

// One row, one sequential stream: lines alternate between two accumulator sets to hide FMA latency.
template <class V, int T>
inline void dot_stream(const typename V::WT* w, int K, const typename V::XT* const* x, float* out, int os,
                       int pf) {
  constexpr int LINE = 64 / int(sizeof(typename V::WT));
  constexpr int J = LINE / V::W > 0 ? LINE / V::W : 1;
  constexpr int STEP = J * V::W;
  typename V::R acc[2][T];
  for (int u = 0; u < 2; ++u)
    for (int t = 0; t < T; ++t) acc[u][t] = V::zero();
  int k = 0;
  for (; k + 2 * STEP <= K; k += 2 * STEP) {
    if (pf > 0) __builtin_prefetch(reinterpret_cast<const char*>(w + k) + pf, 0, 3);
    if (pf > 0) __builtin_prefetch(reinterpret_cast<const char*>(w + k) + pf + 64, 0, 3);
    for (int u = 0; u < 2; ++u)
      for (int j = 0; j < J; ++j) {
        typename V::WV wv = V::load_w(w + k + u * STEP + j * V::W);
        for (int t = 0; t < T; ++t) acc[u][t] = V::fma(acc[u][t], wv, V::load_x(x[t] + k + u * STEP + j * V::W));
      }
  }
  for (; k + V::W <= K; k += V::W) {
    typename V::WV wv = V::load_w(w + k);
    for (int t = 0; t < T; ++t) acc[0][t] = V::fma(acc[0][t], wv, V::load_x(x[t] + k));
  }
  for (int t = 0; t < T; ++t) {
    float s = V::hsum(acc[0][t]) + V::hsum(acc[1][t]);
    for (int kk = k; kk < K; ++kk) s += V::w_scalar(w + kk) * V::x_scalar(x[t] + kk);
    out[t * os] = s;
  }
}

template <class V, int T>
inline void dot_rows_t(const typename V::WT* w, int64_t ld, int K, int rows,
                       const typename V::XT* const* x, float* out, int os, int pf, int row_block) {
  if (row_block == 1) {
    for (int r = 0; r < rows; ++r) dot_stream<V, T>(w + r * ld, K, x, out + r, os, pf);
    return;
  }
  constexpr int R = rows_per_block<T, V::NACC>();
  int r = 0;
  for (; r + R <= rows; r += R) dot_block<V, T, R>(w + r * ld, ld, K, x, out + r, os, pf);
  for (; r < rows; ++r) dot_block<V, T, 1>(w + r * ld, ld, K, x, out + r, os, pf);
}

template <class V>
void dot_rows(const void* wp, int64_t ld, int K, int rows, const void* const* xp, int T, float* out,
              int os, int pf, int rb) {
  auto w = static_cast<const typename V::WT*>(wp);
  auto x = reinterpret_cast<const typename V::XT* const*>(xp);
  switch (T) {
    case 1: dot_rows_t<V, 1>(w, ld, K, rows, x, out, os, pf, rb); break;
    case 2: dot_rows_t<V, 2>(w, ld, K, rows, x, out, os, pf, rb); break;
    case 3: dot_rows_t<V, 3>(w, ld, K, rows, x, out, os, pf, rb); break;
    default: dot_rows_t<V, 4>(w, ld, K, rows, x, out, os, pf, rb); break;
  }
}

inline float bf16_to_f32(uint16_t v) {
  uint32_t bits = uint32_t(v) << 16;
  float f;
  __builtin_memcpy(&f, &bits, 4);
  return f;
}
