// The native runner behind the binding (module.cpp): the ISA's kernels chosen at run time, one MoE layer's
// expert table, and Runner, the pinned worker pool with the entry points the engine calls. Included by module.cpp
// alone (pybind11's GIL release inside the entry points).
#pragma once

#include <pybind11/pybind11.h>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels.h"
#include "moe.h"
#include "pool.h"

namespace killick {
namespace {

namespace py = pybind11;

struct IsaEntry {
  const char* name;
  const KernelTable* (*table)();
  bool (*supported)();
};

#if defined(__x86_64__) || defined(__i386__)
bool has_avx2() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }
bool has_avx512() { return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw"); }
bool has_avx512bf16() { return has_avx512() && __builtin_cpu_supports("avx512bf16"); }
// AMX-TILE and AMX-BF16 (CPUID 7.0 EDX bits 24 and 22), and the tile data state granted to this process: Linux
// gives it only when asked (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA, kernel 5.16 on), once for
// every thread. Asked once; a refusal leaves the ISA off.
bool has_amx() {
  static const bool ok = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!has_avx512bf16() || !__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!((d >> 22) & 1u) || !((d >> 24) & 1u)) return false;
#if defined(__linux__) && defined(SYS_arch_prctl)
    constexpr int kReqXcompPerm = 0x1023, kXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
#else
    return false;
#endif
  }();
  return ok;
}
#endif
bool always() { return true; }

// Best first. An ISA appears only if its translation unit was compiled (build.py defines the macros).
std::vector<IsaEntry> isa_entries() {
  std::vector<IsaEntry> out;
#ifdef KILLICK_HAVE_AMX
  out.push_back({"amx", table_amx, has_amx});
#endif
#ifdef KILLICK_HAVE_AVX512BF16
  out.push_back({"avx512bf16", table_avx512bf16, has_avx512bf16});
#endif
#ifdef KILLICK_HAVE_AVX512
  out.push_back({"avx512", table_avx512, has_avx512});
#endif
#ifdef KILLICK_HAVE_AVX2
  out.push_back({"avx2", table_avx2, has_avx2});
#endif
  out.push_back({"scalar", table_scalar, always});
  return out;
}

std::vector<std::string> supported_isas() {
  std::vector<std::string> out;
  for (const auto& e : isa_entries())
    if (e.supported()) out.push_back(e.name);
  return out;
}

const KernelTable* table_for(const std::string& isa) {
  for (const auto& e : isa_entries())
    if (isa == e.name && e.supported()) return e.table();
  throw std::invalid_argument("ISA '" + isa + "' is not available on this machine/build");
}

// One MoE layer's experts, checked once: expert e's gate_up [2I, H] at gu + e * gu_estride elements (rows
// ld_gu apart), its down [H, I] at dn + e * dn_estride (rows ld_dn apart).
struct Table {
  Format fmt;
  int H, I;
  uint64_t gu, dn;
  int64_t gu_estride, ld_gu, dn_estride, ld_dn, E;
  Table(int fmt_, int H_, int I_, uint64_t gu_, int64_t gu_estride_, int64_t ld_gu_, uint64_t dn_,
        int64_t dn_estride_, int64_t ld_dn_, int64_t E_)
      : fmt(check_format(fmt_)), H(H_), I(I_), gu(gu_), dn(dn_), gu_estride(gu_estride_), ld_gu(ld_gu_),
        dn_estride(dn_estride_), ld_dn(ld_dn_), E(E_) {
    if (H < 1 || I < 1 || E < 1) throw std::invalid_argument("an expert table needs H, I and E >= 1");
  }
  static Format check_format(int fmt) {
    if (fmt != kF32 && fmt != kBF16) throw std::invalid_argument("unknown weight format tag");
    return Format(fmt);
  }
};

struct Runner {
  std::unique_ptr<Pool> pool_;
  Pool& pool;
  std::string isa;             // best supported unless set (isa property)
  const KernelTable* kernels;  // isa's kernels
  int row_block = 0;  // kernel walk order, see DotRowsFn
  int claim_rows = 64;  // rows a worker claims at a time, 1..kChunkRows (see moe.cpp)
  bool guided = true;   // claims shrink towards the end of each phase
  int least_claim = 8;  // to this many rows (two four-row blocks)
  int prefetch_hint = 3;  // __builtin_prefetch locality of the software prefetches (3: prefetcht0)
  int prefetch_bytes = 512;  // software prefetch distance along each weight row stream (0: none)
  int tile_tokens = 0;  // calls averaging this many tokens an expert take the tile path, where isa has one
  Runner(int threads, bool pin, int spin_us, int caller_joins)
      : pool_(std::make_unique<Pool>(threads, pin, spin_us, caller_joins)), pool(*pool_),
        isa(supported_isas().front()), kernels(table_for(isa)) {}

  void set_isa(const std::string& name) {
    kernels = table_for(name);
    isa = name;
  }

  // Tasks as addresses: (gate_up, down, token, weight) per task. Returns at once (wait() for the result).
  void submit_moe(int fmt, int H, int I, int64_t ld_gu, int64_t ld_dn, const std::vector<uint64_t>& gate_up,
                  const std::vector<uint64_t>& down, const std::vector<int64_t>& tokens,
                  const std::vector<float>& weights, uint64_t x, int64_t x_stride, uint64_t y, int64_t y_stride,
                  int T) {
    MoeArgs a = args(Table::check_format(fmt), H, I, ld_gu, ld_dn, x, kF32, x_stride, y, kF32, y_stride, T);
    size_t n = gate_up.size();
    if (down.size() != n || tokens.size() != n || weights.size() != n)
      throw std::invalid_argument("task arrays differ in length");
    check_tokens(tokens, T);
    py::gil_scoped_release release;
    auto lock = hold();
    start(a, gate_up, down, tokens, weights, false);
  }

  // Tasks as expert ids into one layer's table; `wait`: also wait for the result before returning (one call
  // a layer: the caller's code and data are cold after each call's streaming, and every crossing costs).
  void submit_table(const Table& t, const std::vector<int64_t>& experts, const std::vector<int64_t>& tokens,
                    const std::vector<float>& weights, uint64_t x, int64_t x_stride, uint64_t y, int64_t y_stride,
                    int T, bool wait) {
    MoeArgs a = args(t.fmt, t.H, t.I, t.ld_gu, t.ld_dn, x, kF32, x_stride, y, kF32, y_stride, T);
    size_t n = experts.size();
    if (tokens.size() != n || weights.size() != n)
      throw std::invalid_argument("experts, tokens and weights must have one entry per task");
    check_tokens(tokens, T);
    check_experts(t, experts);
    py::gil_scoped_release release;
    auto lock = hold();
    addresses(t, experts);
    start(a, gu_, dn_, tokens, weights, wait);
  }

  // The engine's call for one MoE layer's CPU experts (engine/experts/cpu_runner.py), in one crossing: task i
  // runs expert experts[i] of the table on x row rows[i] into output row i, weight 1. x [T, H] and out [n, H]
  // are f32 or bf16 (x_fmt, out_fmt) with unit inner stride; out is overwritten. The job's workers read x's
  // rows and write out's in their own formats, so the caller needs no gather, no zeroed buffer and no
  // conversion, each a torch op that costs 20-100 us with caches emptied by the previous call's streaming.
  void run_gather(const Table& t, const std::vector<int64_t>& experts, const std::vector<int64_t>& rows,
                  uint64_t x, int x_fmt, int64_t x_stride, int T, uint64_t out, int out_fmt, int64_t out_stride) {
    const size_t n = experts.size();
    Format xf = Table::check_format(x_fmt), of = Table::check_format(out_fmt);
    check_gather(t, experts, rows, T);
    py::gil_scoped_release release;
    auto lock = hold();
    gather(t, n, experts.data(), rows.data(), x, xf, x_stride, T, out, of, out_stride, nullptr);
  }

  // run_gather's work on checked tasks, mu_ held, no GIL needed: task i's output lands in out row
  // out_rows[i] (row i when out_rows is null). The job reads x's rows and writes out's in their own formats
  // (its workers, not this thread, convert). The graph mailbox (Mailbox below) calls it from its thread.
  void gather(const Table& t, size_t n, const int64_t* experts, const int64_t* rows, uint64_t x, Format xf,
              int64_t x_stride, int T, uint64_t out, Format of, int64_t out_stride, const int64_t* out_rows) {
    submit_gather(t, n, experts, rows, x, xf, x_stride, T, out, of, out_stride, out_rows);
    pool.wait();
  }
  // gather's job submitted, not waited for (GatherJobs: on_done as Pool::submit's).
  void submit_gather(const Table& t, size_t n, const int64_t* experts, const int64_t* rows, uint64_t x, Format xf,
                     int64_t x_stride, int T, uint64_t out, Format of, int64_t out_stride, const int64_t* out_rows,
                     std::function<void()> on_done = {}) {
    pool.wait();  // the planner's job and the addresses below may still be in use
    if (!out_rows) {
      for (size_t i = iota_.size(); i < n; ++i) iota_.push_back(int64_t(i));
      out_rows = iota_.data();
    }
    addresses(t, experts, n);
    MoeArgs a = args(t.fmt, t.H, t.I, t.ld_gu, t.ld_dn, x, xf, x_stride, out, of, out_stride, T);
    pool.submit(planner_.plan(a, n, gu_.data(), dn_.data(), rows, nullptr, out_rows), std::move(on_done));
  }
  // run_gather's checks, for GatherJobs::post.
  static void check_gather(const Table& t, const std::vector<int64_t>& experts, const std::vector<int64_t>& rows,
                           int T) {
    if (rows.size() != experts.size()) throw std::invalid_argument("experts and rows must have one entry per task");
    check_tokens(rows, T);
    check_experts(t, experts);
  }

  bool planner_last_tiles() {
    auto lock = hold();
    return planner_.last_tiles();
  }

  // mu_ taken once no GatherJobs job holds the runner: every entry point that submits or reads the planner. A
  // posted job holds it from its post() until its flag is up (GatherJobs clears held_), so no other call's job
  // queues between and delays that flag.
  std::unique_lock<std::mutex> hold() {
    std::unique_lock<std::mutex> lock(mu_);
    free_.wait(lock, [&] { return !held_; });
    return lock;
  }
  std::mutex mu_;  // one submitting thread at a time: the planner's job and gu_/dn_ are shared
  std::condition_variable free_;
  bool held_ = false;  // a GatherJobs job is in flight (mu_ guards it)

  uint64_t read(uint64_t p, size_t nbytes, int streams, size_t chunk_bytes) {
    if (streams != 1 && streams != 2 && streams != 4)
      throw std::invalid_argument("read streams must be 1, 2 or 4, got " + std::to_string(streams));
    if (chunk_bytes % 64)
      throw std::invalid_argument("read chunks must be a multiple of 64 bytes, got " + std::to_string(chunk_bytes));
    py::gil_scoped_release release;
    auto lock = hold();
    return pool_read(pool, kernels, reinterpret_cast<const void*>(p), nbytes, streams, chunk_bytes);
  }

 private:
  MoeArgs args(Format fmt, int H, int I, int64_t ld_gu, int64_t ld_dn, uint64_t x, Format xf, int64_t x_stride,
               uint64_t y, Format yf, int64_t y_stride, int T) const {
    return MoeArgs{kernels, fmt, H, I, ld_gu, ld_dn, reinterpret_cast<const void*>(x), xf, x_stride,
                   reinterpret_cast<void*>(y), yf, y_stride, T, prefetch_bytes, prefetch_hint, row_block,
                   claim_rows, guided, least_claim, tile_tokens};
  }
  static void check_experts(const Table& t, const std::vector<int64_t>& experts) {
    for (int64_t e : experts)
      if (e < 0 || e >= t.E)
        throw std::invalid_argument("expert id " + std::to_string(e) + " is outside the table's " +
                                    std::to_string(t.E) + " experts");
  }
  // gu_/dn_ <- the weight addresses of `experts` in t (mu_ held, no job in flight).
  void addresses(const Table& t, const std::vector<int64_t>& experts) { addresses(t, experts.data(), experts.size()); }
  void addresses(const Table& t, const int64_t* experts, size_t n) {
    int64_t es = t.fmt == kBF16 ? 2 : 4;
    gu_.resize(n);
    dn_.resize(n);
    for (size_t i = 0; i < n; ++i) {
      gu_[i] = t.gu + uint64_t(experts[i] * t.gu_estride * es);
      dn_[i] = t.dn + uint64_t(experts[i] * t.dn_estride * es);
    }
  }
  static void check_tokens(const std::vector<int64_t>& tokens, int T) {
    for (int64_t t : tokens)
      if (t < 0 || t >= T)
        throw std::invalid_argument("token " + std::to_string(t) + " is outside x's " + std::to_string(T) +
                                    " rows");
  }
  // Checked tasks, the GIL released and mu_ held: wait for the job in flight (the planner reuses its job),
  // plan, submit, and maybe wait.
  void start(const MoeArgs& a, const std::vector<uint64_t>& gate_up, const std::vector<uint64_t>& down,
             const std::vector<int64_t>& tokens, const std::vector<float>& weights, bool wait) {
    pool.wait();
    pool.submit(planner_.plan(a, gate_up.size(), gate_up.data(), down.data(), tokens.data(), weights.data()));
    if (wait) pool.wait();
  }

  MoePlanner planner_;
  std::vector<uint64_t> gu_, dn_;  // submit_table's and run_gather's addresses, kept across calls
  std::vector<int64_t> iota_;      // 0, 1, ...: run_gather's output rows
};

}  // namespace
}  // namespace killick
