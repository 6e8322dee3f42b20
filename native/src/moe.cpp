#include "moe.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

namespace killick {
namespace {

constexpr int kChunkRows = 64;  // rows per dot_rows call at most: bounds the per-thread scratch

uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return uint16_t(u >> 16);
}

float bf16_to_f32(uint16_t v) {
  uint32_t u = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// [begin, end) of n items for worker w of nw, as even as integers allow (the read job's static split).
inline void split(int64_t n, int w, int nw, int64_t& begin, int64_t& end) {
  begin = n * w / nw;
  end = n * (w + 1) / nw;
}

template <class T>
struct Aligned {  // 64-byte aligned scratch, so chunks written by different workers share no line; grows only
  std::unique_ptr<T[], void (*)(T*)> p{nullptr, [](T* q) { std::free(q); }};
  size_t cap = 0;
  void reserve(size_t n) {
    if (n <= cap && p) return;
    size_t bytes = (n * sizeof(T) + 63) / 64 * 64;
    p.reset(static_cast<T*>(std::aligned_alloc(64, bytes ? bytes : 64)));
    cap = bytes / sizeof(T);
  }
  T* get() const { return p.get(); }
};

}  // namespace

class MoeJob : public Job {
 public:
  // Groups the tasks (see MoePlanner::plan), picks the vector kernels or the tile path and sets up the scratch
  // for one run; not while in flight.
  void plan(const MoeArgs& a, size_t n, const uint64_t* gate_up, const uint64_t* down, const int64_t* tokens,
            const float* weights, const int64_t* out_rows) {
    a_ = a;
    gather_ = out_rows != nullptr;
    tile_ = a.table->tile && a.fmt == kBF16 && a.tile_tokens > 0 && a.H % 32 == 0 && a.I % 32 == 0;
    group(n, gate_up, down, tokens, weights, out_rows, tile_ ? kMaxTileTokens : kMaxTokens);
    if (tile_ && n < size_t(a.tile_tokens) * g_.size()) {  // too few tokens an expert: the vector kernels
      tile_ = false;
      group(n, gate_up, down, tokens, weights, out_rows, kMaxTokens);
    }
    es_ = a.fmt == kBF16 ? 2 : 4;
    streams_ = a.row_block == kQuadWalk ? 4 : (a.row_block == kPairWalk ? 2 : 1);
    // Rows a worker claims at a time (gate + up rows in phase 0, output rows in phase 1): shorter claims end
    // a phase more evenly, longer ones give each worker longer sequential streams.
    claim_ = std::min(kChunkRows, std::max(1, a.claim_rows));
    least_ = std::min(claim_, std::max(1, a.least_claim));
    tokens_.clear();
    if (!gather_) {
      for (const ExpertGroup& eg : g_) tokens_.insert(tokens_.end(), eg.tok, eg.tok + eg.ntok);
      std::sort(tokens_.begin(), tokens_.end());
      tokens_.erase(std::unique(tokens_.begin(), tokens_.end()), tokens_.end());
    }
    tile_ ? plan_tiles() : plan_vector();
    next_pk_.store(0, std::memory_order_relaxed);  // published by Pool::submit
    next_gu_.store(0, std::memory_order_relaxed);
    next_dn_.store(0, std::memory_order_relaxed);
  }
  int phases() const override { return tile_ ? 3 : 2; }
  void run(int phase, int w, int nw) override {
    if (tile_)
      phase == 0 ? pack(w, nw) : (phase == 1 ? gate_up_tiles(w, nw) : down(w, nw));
    else
      phase == 0 ? gate_up(w, nw) : down(w, nw);
  }
  bool tiles() const { return tile_; }

 private:
  // Claims the next rows of a phase's flattened range [0, total), never across a segment (an expert's I
  // rows, or the H output rows): returns how many (0 once the phase is done) and their start. Guided claims
  // shrink from claim_ to least_ rows as the phase runs out (a share of what is left per worker), so the
  // workers reach the phase barrier together instead of waiting on one full-size claim.
  int claim(std::atomic<int64_t>& next, int64_t total, int64_t seg, int nw, int64_t& start) {
    int64_t cur = next.load(std::memory_order_relaxed);
    for (;;) {
      if (cur >= total) return 0;
      int64_t n = claim_;
      if (a_.guided) {
        int64_t share = (total - cur + 2 * nw - 1) / (2 * nw);
        share = (share + least_ - 1) / least_ * least_;
        n = std::max<int64_t>(least_, std::min<int64_t>(claim_, share));
      }
      n = std::min(n, seg - cur % seg);
      if (next.compare_exchange_weak(cur, cur + n, std::memory_order_relaxed)) {
        start = cur;
        return int(n);
      }
    }
  }

  // Tasks on one gate_up address share a group (first-appearance order) until it holds cap tokens.
  // An open-addressed table of slots (address -> latest group of it) sized to twice the tasks: no hashing
  // library, nothing allocated once warm. Fibonacci hashing takes the product's top bits: experts sit a
  // power-of-two multiple apart, so the low bits of their addresses (and of the product) are all alike.
  void group(size_t n, const uint64_t* gate_up, const uint64_t* down, const int64_t* tokens, const float* weights,
             const int64_t* out_rows, int cap) {
    g_.clear();
    int bits = 4;
    while ((size_t(1) << bits) < 2 * n) ++bits;
    const size_t size = size_t(1) << bits;
    slots_.assign(size, -1);
    for (size_t i = 0; i < n; ++i) {
      size_t s = size_t((gate_up[i] * 0x9E3779B97F4A7C15ull) >> (64 - bits));
      while (slots_[s] >= 0 && g_[size_t(slots_[s])].gate_up != reinterpret_cast<const void*>(gate_up[i]))
        s = (s + 1) & (size - 1);
      if (slots_[s] < 0 || g_[size_t(slots_[s])].ntok == cap) {
        g_.push_back(ExpertGroup{reinterpret_cast<const void*>(gate_up[i]), reinterpret_cast<const void*>(down[i]),
                                 0, {}, {}, {}});
        slots_[s] = int64_t(g_.size() - 1);
      }
      ExpertGroup& g = g_[size_t(slots_[s])];
      g.tok[g.ntok] = int(tokens[i]);
      g.w[g.ntok] = weights ? weights[i] : 1.f;
      g.out[g.ntok] = out_rows ? out_rows[i] : 0;
      ++g.ntok;
    }
  }

  // The vector kernels read each token's x row in their activation format (bf16 for VDPBF16PS and the AVX2
  // bf16 path, else f32): in place when x already is, else converted here once per routed token.
  void plan_vector() {
    bf_ = a_.table->x_bf16[a_.fmt];
    ipad_ = (a_.I + 15) / 16 * 16;
    act_.reserve(g_.size() * kMaxTokens * ipad_);
    if (bf_) actbf_.reserve(g_.size() * kMaxTokens * ipad_);
    direct_ = a_.x_fmt == (bf_ ? kBF16 : kF32);
    if (direct_) return;
    hpad_ = (a_.H + 31) / 32 * 32;
    if (bf_)
      xbf_.reserve(size_t(a_.T) * hpad_);
    else
      xf_.reserve(size_t(a_.T) * hpad_);
    seen_.assign(size_t(a_.T), 0);
    for (const ExpertGroup& eg : g_)
      for (int t = 0; t < eg.ntok; ++t) {
        const int tok = eg.tok[t];
        if (seen_[size_t(tok)]) continue;
        seen_[size_t(tok)] = 1;
        if (bf_) {  // x is f32
          const float* src = static_cast<const float*>(a_.x) + tok * a_.x_stride;
          uint16_t* dst = xbf_.get() + size_t(tok) * hpad_;
          for (int h = 0; h < a_.H; ++h) dst[h] = f32_to_bf16(src[h]);
        } else {  // x is bf16
          const uint16_t* src = static_cast<const uint16_t*>(a_.x) + tok * a_.x_stride;
          float* dst = xf_.get() + size_t(tok) * hpad_;
          for (int h = 0; h < a_.H; ++h) dst[h] = bf16_to_f32(src[h]);
        }
      }
  }
  const void* x_row(int tok) const {
    if (direct_) return static_cast<const char*>(a_.x) + tok * a_.x_stride * (a_.x_fmt == kBF16 ? 2 : 4);
    return bf_ ? static_cast<const void*>(xbf_.get() + size_t(tok) * hpad_)
               : static_cast<const void*>(xf_.get() + size_t(tok) * hpad_);
  }
  size_t act_off(size_t g, int slot) const { return (g * kMaxTokens + slot) * ipad_; }

  // The tile path's scratch: each group's x rows and SwiGLU outputs packed in pairs, token-minor (DotTileFn's
  // xp), at prefix offsets in 32-bit words.
  void plan_tiles() {
    const size_t G = g_.size();
    xoff_.resize(G + 1);
    aoff_.resize(G + 1);
    xoff_[0] = aoff_[0] = 0;
    for (size_t g = 0; g < G; ++g) {
      xoff_[g + 1] = xoff_[g] + size_t(g_[g].ntok) * size_t(a_.H / 2);
      aoff_[g + 1] = aoff_[g] + size_t(g_[g].ntok) * size_t(a_.I / 2);
    }
    xp_.reserve(xoff_[G]);
    actp_.reserve(aoff_[G]);
  }

  // Tile phase 0: groups claimed one at a time; each packs its tokens' x rows (f32 or bf16) as bf16 pairs.
  void pack(int, int) {
    const int P = a_.H / 2;
    for (int64_t g; (g = next_pk_.fetch_add(1, std::memory_order_relaxed)) < int64_t(g_.size());) {
      const ExpertGroup& eg = g_[size_t(g)];
      const int T = eg.ntok;
      uint32_t* dst = xp_.get() + xoff_[size_t(g)];
      for (int t = 0; t < T; ++t) {
        if (a_.x_fmt == kBF16) {
          const uint16_t* src = static_cast<const uint16_t*>(a_.x) + eg.tok[t] * a_.x_stride;
          for (int p = 0; p < P; ++p) dst[p * T + t] = uint32_t(src[2 * p]) | uint32_t(src[2 * p + 1]) << 16;
        } else {
          const float* src = static_cast<const float*>(a_.x) + eg.tok[t] * a_.x_stride;
          for (int p = 0; p < P; ++p)
            dst[p * T + t] = uint32_t(f32_to_bf16(src[2 * p])) | uint32_t(f32_to_bf16(src[2 * p + 1])) << 16;
        }
      }
    }
  }

  static float swiglu(float g, float u) { return g / (1.f + std::exp(-g)) * u; }

  // Phase 0: rows (expert g, i) of the flattened [G * I] range, claimed as in claim() (a slow or
  // descheduled worker takes fewer claims instead of holding up the phase); gate row i and up row I+i
  // together.
  void gate_up(int, int nw) {
    float gbuf[kMaxTokens * kChunkRows], ubuf[kMaxTokens * kChunkRows];
    auto dot = a_.table->dot[a_.fmt];
    const int64_t total = int64_t(g_.size()) * a_.I;
    for (int64_t start; int n = claim(next_gu_, total, a_.I, nw, start);) {
      size_t g = size_t(start / a_.I);
      int i0 = int(start % a_.I);
      const ExpertGroup& eg = g_[g];
      const void* xs[kMaxTokens];
      for (int t = 0; t < eg.ntok; ++t) xs[t] = x_row(eg.tok[t]);
      auto base = static_cast<const char*>(eg.gate_up);
      const char* gate = base + i0 * a_.ld_gu * es_;
      const char* up = base + (a_.I + i0) * a_.ld_gu * es_;
      if (streams_ > 1) {
        const int64_t row = a_.ld_gu * es_;
        const void* const* xss[4] = {xs, xs, xs, xs};
        int h = streams_ == 4 ? n / 2 : 0;  // quad walk: halves of the gate and up rows as four streams
        if (h > 0) {
          const void* w[4] = {gate, gate + h * row, up, up + h * row};
          float* out[4] = {gbuf, gbuf + h, ubuf, ubuf + h};
          a_.table->dots[a_.fmt](4, w, a_.ld_gu, a_.H, h, xss, eg.ntok, out, kChunkRows, a_.prefetch_bytes,
                                 a_.prefetch_hint);
        }
        if (n > 2 * h) {  // the pair walk, or the quad walk's odd last row
          const void* w[2] = {gate + 2 * h * row, up + 2 * h * row};
          float* out[2] = {gbuf + 2 * h, ubuf + 2 * h};
          a_.table->dots[a_.fmt](2, w, a_.ld_gu, a_.H, n - 2 * h, xss, eg.ntok, out, kChunkRows,
                                 a_.prefetch_bytes, a_.prefetch_hint);
        }
      } else {
        dot(gate, a_.ld_gu, a_.H, n, xs, eg.ntok, gbuf, kChunkRows, a_.prefetch_bytes, a_.prefetch_hint,
            a_.row_block, up);
        dot(up, a_.ld_gu, a_.H, n, xs, eg.ntok, ubuf, kChunkRows, a_.prefetch_bytes, a_.prefetch_hint,
            a_.row_block, nullptr);
      }
      for (int t = 0; t < eg.ntok; ++t) {
        float* act = act_.get() + act_off(g, t) + i0;
        for (int r = 0; r < n; ++r) act[r] = swiglu(gbuf[t * kChunkRows + r], ubuf[t * kChunkRows + r]);
        if (bf_)
          for (int r = 0; r < n; ++r) actbf_.get()[act_off(g, t) + i0 + r] = f32_to_bf16(act[r]);
      }
    }
  }

  // Tile phase 1: gate_up's claims on the tile path; the SwiGLU outputs go out packed for phase 2 (two claims
  // may each write one half of a word).
  void gate_up_tiles(int, int nw) {
    float gbuf[kMaxTileTokens * kChunkRows], ubuf[kMaxTileTokens * kChunkRows];
    const int64_t total = int64_t(g_.size()) * a_.I;
    for (int64_t start; int n = claim(next_gu_, total, a_.I, nw, start);) {
      const size_t g = size_t(start / a_.I);
      const int i0 = int(start % a_.I);
      const ExpertGroup& eg = g_[g];
      const int T = eg.ntok;
      auto base = static_cast<const char*>(eg.gate_up);
      const void* w[2] = {base + i0 * a_.ld_gu * 2, base + (a_.I + i0) * a_.ld_gu * 2};
      float* out[2] = {gbuf, ubuf};
      a_.table->tile(2, w, a_.ld_gu, a_.H, n, xp_.get() + xoff_[g], T, out, kChunkRows, a_.prefetch_bytes);
      uint16_t* ap = reinterpret_cast<uint16_t*>(actp_.get() + aoff_[g]);
      for (int t = 0; t < T; ++t)
        for (int r = 0; r < n; ++r) {
          const int i = i0 + r;
          ap[(size_t(i >> 1) * T + t) * 2 + (i & 1)] =
              f32_to_bf16(swiglu(gbuf[t * kChunkRows + r], ubuf[t * kChunkRows + r]));
        }
    }
  }

  // Last phase: output rows claimed as in claim(). Accumulate mode: the claimer sums every expert over its
  // rows and adds them to y once, so no two workers write the same row; gather mode: each task's rows go
  // straight to its own output row.
  void down(int, int nw) {
    thread_local std::vector<float> acc;
    if (!gather_) acc.resize(size_t(a_.T) * kChunkRows);
    float buf[4][kMaxTileTokens * kChunkRows];
    auto dot = a_.table->dot[a_.fmt];
    const int64_t total = g_.empty() ? 0 : a_.H;
    for (int64_t h; int n = claim(next_dn_, total, a_.H, nw, h);) {
      for (int tok : tokens_) std::fill_n(acc.data() + size_t(tok) * kChunkRows, n, 0.f);
      for (size_t g = 0; g < g_.size();) {
        size_t m = 1;
        if (tile_) {
          const void* w = static_cast<const char*>(g_[g].down) + h * a_.ld_dn * 2;
          float* out = buf[0];
          a_.table->tile(1, &w, a_.ld_dn, a_.I, n, actp_.get() + aoff_[g], g_[g].ntok, &out, kChunkRows,
                         a_.prefetch_bytes);
        } else {
          // The stream walks take up to streams_ experts at once when they have as many tokens (always, in
          // decode); a lone expert goes through the one-row walk.
          while (m < size_t(streams_) && g + m < g_.size() && g_[g + m].ntok == g_[g].ntok) ++m;
          if (m == 3) m = 2;
          const void* as[4][kMaxTokens];
          const void* w[4];
          float* out[4];
          for (size_t e = 0; e < m; ++e) {
            for (int t = 0; t < g_[g + e].ntok; ++t)
              as[e][t] = bf_ ? static_cast<const void*>(actbf_.get() + act_off(g + e, t))
                             : static_cast<const void*>(act_.get() + act_off(g + e, t));
            w[e] = static_cast<const char*>(g_[g + e].down) + h * a_.ld_dn * es_;
            out[e] = buf[e];
          }
          if (m > 1) {
            const void* const* xs[4] = {as[0], as[1], as[2], as[3]};
            a_.table->dots[a_.fmt](int(m), w, a_.ld_dn, a_.I, n, xs, g_[g].ntok, out, kChunkRows,
                                   a_.prefetch_bytes, a_.prefetch_hint);
          } else {
            // the next expert's rows h.. come next: the four-row walk's prefetches run on into them
            const void* then = g + 1 < g_.size() ? static_cast<const char*>(g_[g + 1].down) + h * a_.ld_dn * es_
                                                 : nullptr;
            dot(w[0], a_.ld_dn, a_.I, n, as[0], g_[g].ntok, buf[0], kChunkRows, a_.prefetch_bytes,
                a_.prefetch_hint, streams_ > 1 ? 1 : a_.row_block, then);
          }
        }
        for (size_t e = 0; e < m; ++e) emit(g_[g + e], buf[e], h, n, acc.data());
        g += m;
      }
      if (gather_) continue;
      float* y = static_cast<float*>(a_.y);
      for (int tok : tokens_) {
        float* dst = y + tok * a_.y_stride + h;
        const float* src = acc.data() + size_t(tok) * kChunkRows;
        for (int r = 0; r < n; ++r) dst[r] += src[r];
      }
    }
  }

  // One group's output rows h..h+n (buf[t * kChunkRows + r]): weighted into the claim's sums, or written to
  // each task's output row (f32 or bf16 rounded to nearest even).
  void emit(const ExpertGroup& eg, const float* buf, int64_t h, int n, float* acc) const {
    for (int t = 0; t < eg.ntok; ++t) {
      const float* src = buf + t * kChunkRows;
      if (!gather_) {
        float* dst = acc + size_t(eg.tok[t]) * kChunkRows;
        for (int r = 0; r < n; ++r) dst[r] += eg.w[t] * src[r];
      } else if (a_.y_fmt == kF32) {
        std::memcpy(static_cast<float*>(a_.y) + eg.out[t] * a_.y_stride + h, src, size_t(n) * 4);
      } else {
        uint16_t* dst = static_cast<uint16_t*>(a_.y) + eg.out[t] * a_.y_stride + h;
        for (int r = 0; r < n; ++r) dst[r] = f32_to_bf16(src[r]);
      }
    }
  }

  MoeArgs a_;
  std::vector<ExpertGroup> g_;
  std::vector<int> tokens_;  // the distinct tokens this job adds to (accumulate mode)
  std::vector<int64_t> slots_;  // group()'s table: index into g_, -1 empty
  std::vector<uint8_t> seen_;   // plan_vector's routed tokens
  bool gather_ = false;     // out rows per task (MoeArgs)
  bool tile_ = false;       // the tile path (three phases: pack, gate/up, down)
  bool direct_ = true;      // the vector kernels read x in place
  int streams_ = 1;         // row streams a kernel call walks side by side (the stream walks: 2 or 4)
  int claim_ = kChunkRows;  // rows a claim takes at most
  int least_ = 8;  // and at least (guided claims), but for a segment's last rows
  // Work counters, claimed with fetch_add; apart from each other and from the read-only fields.
  alignas(64) std::atomic<int64_t> next_pk_{0};
  alignas(64) std::atomic<int64_t> next_gu_{0};
  alignas(64) std::atomic<int64_t> next_dn_{0};
  char pad_[64];
  int es_ = 2, ipad_ = 0, hpad_ = 0;
  bool bf_ = false;
  Aligned<float> act_;       // [G][kMaxTokens][ipad] SwiGLU output, fp32
  Aligned<uint16_t> actbf_;  // same, bf16 (bf16-activation kernels only)
  Aligned<uint16_t> xbf_;    // [T][hpad] x in bf16, where the kernels want bf16 and x is f32
  Aligned<float> xf_;        // [T][hpad] x in f32, where the kernels want f32 and x is bf16
  std::vector<size_t> xoff_, aoff_;  // tile path: group g's packed x and SwiGLU outputs, in words
  Aligned<uint32_t> xp_, actp_;
};

namespace {

class ReadJob : public Job {
 public:
  ReadJob(const KernelTable* t, const void* p, size_t n, int workers, int streams, size_t chunk)
      : t_(t), p_(static_cast<const char*>(p)), n_(n), streams_(streams), chunk_(chunk),
        out_(size_t(workers) * 8, 0) {}
  int phases() const override { return 1; }
  void run(int, int w, int nw) override {
    uint64_t acc = 0;
    if (chunk_ == 0) {  // STREAM-style: each worker its own contiguous part
      int64_t pages = int64_t((n_ + 4095) / 4096), b, e;
      split(pages, w, nw, b, e);
      size_t lo = size_t(b) * 4096, hi = std::min(n_, size_t(e) * 4096);
      if (hi > lo) acc = t_->read(p_ + lo, hi - lo, streams_);
    } else {  // chunks claimed in turn: a slow core reads fewer of them instead of holding up the pass
      for (size_t lo; (lo = next_.fetch_add(chunk_, std::memory_order_relaxed)) < n_;)
        acc ^= t_->read(p_ + lo, std::min(chunk_, n_ - lo), streams_);
    }
    out_[size_t(w) * 8] = acc;  // 8 words apart: own line
  }
  uint64_t result() const {
    uint64_t r = 0;
    for (uint64_t v : out_) r ^= v;
    return r;
  }

 private:
  const KernelTable* t_;
  const char* p_;
  size_t n_;
  int streams_;
  size_t chunk_;
  std::vector<uint64_t> out_;
  alignas(64) std::atomic<size_t> next_{0};
};

}  // namespace

MoePlanner::MoePlanner() : job_(std::make_shared<MoeJob>()) {}
MoePlanner::~MoePlanner() = default;

std::shared_ptr<Job> MoePlanner::plan(const MoeArgs& args, size_t n, const uint64_t* gate_up, const uint64_t* down,
                                      const int64_t* tokens, const float* weights, const int64_t* out_rows) {
  job_->plan(args, n, gate_up, down, tokens, weights, out_rows);
  return job_;
}

bool MoePlanner::last_tiles() const { return job_->tiles(); }

uint64_t pool_read(Pool& pool, const KernelTable* table, const void* p, size_t nbytes, int streams,
                   size_t chunk_bytes) {
  auto job = std::make_shared<ReadJob>(table, p, nbytes, pool.threads(), streams, chunk_bytes);
  pool.submit(job);
  pool.wait();
  return job->result();
}

}  // namespace killick
