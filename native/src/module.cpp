// Python binding. Tensors cross as integer addresses, sizes, strides and a format tag: no torch here.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "kernels.h"
#include "moe.h"
#include "pool.h"

namespace py = pybind11;
using namespace killick;

namespace {

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
  // gather's job submitted, not waited for (GatherJobs).
  void submit_gather(const Table& t, size_t n, const int64_t* experts, const int64_t* rows, uint64_t x, Format xf,
                     int64_t x_stride, int T, uint64_t out, Format of, int64_t out_stride, const int64_t* out_rows) {
    pool.wait();  // the planner's job and the addresses below may still be in use
    if (!out_rows) {
      for (size_t i = iota_.size(); i < n; ++i) iota_.push_back(int64_t(i));
      out_rows = iota_.data();
    }
    addresses(t, experts, n);
    MoeArgs a = args(t.fmt, t.H, t.I, t.ld_gu, t.ld_dn, x, xf, x_stride, out, of, out_stride, T);
    pool.submit(planner_.plan(a, n, gu_.data(), dn_.data(), rows, nullptr, out_rows));
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
  // posted job holds it from its post() until its flag is up (GatherJobs::loop takes mu_ directly and clears
  // held_), so no other call's job queues between and delays that flag.
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


// The CPU's share of an expert-cache decode step that runs as one CUDA graph (engine/experts/graph_hybrid.py).
// Per MoE layer a device kernel publishes into page-locked, mapped host memory the layer's row (meta[0]), its
// token count (meta[1]), the routed expert ids [n, KP] and the tokens' normed hidden rows x [n, H], then bumps
// `posted`. This thread sees the bump, runs the pairs whose expert's entry in the host copy of the location
// table is kLocCpu (the native kernels, this runner's pool), writes their unweighted outputs to out rows
// t * KP + k, and stores `done` = posted; the device's join kernel waits for it only where the layer had CPU
// pairs, scales the rows by the routing weights and places them among the GPU's. A publish that had no CPU
// pairs is not waited for, so the next one may overwrite it: the thread rereads `posted` after collecting
// the pairs and takes the newer one instead. Between bursts it spins spin_us, then polls every 50 us.
constexpr int32_t kLocCpu = -3;  // moe_triton.LOC_CPU

// steady-clock nanoseconds (CLOCK_MONOTONIC on Linux: time.perf_counter's clock, in ns)
int64_t now() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
      std::chrono::steady_clock::now().time_since_epoch()).count();
}

class Mailbox {
 public:
  Mailbox(Runner& runner, std::vector<Table> tables, uint64_t posted, uint64_t done, uint64_t meta, uint64_t ids,
          uint64_t x, int x_fmt, uint64_t out, int out_fmt, int H, int KP, int n_max, uint64_t loc, int E,
          int spin_us)
      : r_(runner), tables_(std::move(tables)), posted_(reinterpret_cast<int64_t*>(posted)),
        done_(reinterpret_cast<int64_t*>(done)), meta_(reinterpret_cast<const int32_t*>(meta)),
        ids_(reinterpret_cast<const int32_t*>(ids)), x_(x), xf_(Table::check_format(x_fmt)), out_(out),
        of_(Table::check_format(out_fmt)), H_(H), KP_(KP), n_max_(n_max), loc_(reinterpret_cast<const int32_t*>(loc)),
        E_(E), spin_ns_(int64_t(spin_us) * 1000) {
    if (!posted || !done || !meta || !ids || !x || !out || !loc)
      throw std::invalid_argument("the mailbox needs every buffer's address");
    if (H < 1 || KP < 1 || n_max < 1 || E < 1) throw std::invalid_argument("the mailbox needs H, KP, n_max, E >= 1");
    for (const Table& t : tables_)
      if (t.H != H || t.E != E) throw std::invalid_argument("every layer table must have the mailbox's H and E");
  }
  ~Mailbox() { stop(); }
  Mailbox(const Mailbox&) = delete;
  Mailbox& operator=(const Mailbox&) = delete;

  void start() {
    if (thread_.joinable()) return;
    stop_.store(false);
    thread_ = std::thread([this] { loop(); });
  }
  void stop() {
    stop_.store(true);
    if (thread_.joinable()) thread_.join();
  }
  bool running() const { return thread_.joinable() && !stop_.load(); }

  uint64_t publishes() const { return publishes_.load(); }
  uint64_t pairs() const { return pairs_.load(); }
  uint64_t layers_run() const { return layers_run_.load(); }
  double busy_s() const { return busy_ns_.load() * 1e-9; }
  uint64_t skipped() const { return skipped_.load(); }

 private:
  void loop() {
    int64_t last = __atomic_load_n(done_, __ATOMIC_ACQUIRE), idle_since = now();
    std::vector<int64_t> experts, rows, outs;
    while (!stop_.load(std::memory_order_relaxed)) {
      const int64_t p = __atomic_load_n(posted_, __ATOMIC_ACQUIRE);
      if (p == last) {
        if (now() - idle_since < spin_ns_) {
#if defined(__x86_64__) || defined(__i386__)
          __builtin_ia32_pause();
#endif
        } else {
          std::this_thread::sleep_for(std::chrono::microseconds(50));
        }
        continue;
      }
      const int32_t row = meta_[0], n = meta_[1];
      experts.clear();
      rows.clear();
      outs.clear();
      if (row >= 0 && size_t(row) < tables_.size() && n > 0 && n <= n_max_) {
        const int32_t* lr = loc_ + int64_t(row) * (E_ + 1);
        for (int t = 0; t < n; ++t)
          for (int k = 0; k < KP_; ++k) {
            int32_t e = ids_[t * KP_ + k];
            if (e >= 0 && e < E_ && lr[e] == kLocCpu) {
              experts.push_back(e);
              rows.push_back(t);
              outs.push_back(int64_t(t) * KP_ + k);
            }
          }
      }
      if (__atomic_load_n(posted_, __ATOMIC_ACQUIRE) != p) {  // overwritten while read: take the newer one
        skipped_.fetch_add(1);
        continue;
      }
      if (!experts.empty()) {
        const int64_t t0 = now();
        {
          auto lock = r_.hold();
          r_.gather(tables_[row], experts.size(), experts.data(), rows.data(), x_, xf_, H_, n, out_, of_, H_,
                    outs.data());
        }
        busy_ns_.fetch_add(now() - t0);
        pairs_.fetch_add(experts.size());
        layers_run_.fetch_add(1);
      }
      __atomic_store_n(done_, p, __ATOMIC_RELEASE);
      publishes_.fetch_add(1);
      last = p;
      idle_since = now();
    }
  }

  Runner& r_;
  std::vector<Table> tables_;
  int64_t* posted_;
  int64_t* done_;
  const int32_t* meta_;
  const int32_t* ids_;
  uint64_t x_;
  Format xf_;
  uint64_t out_;
  Format of_;
  int H_, KP_, n_max_;
  const int32_t* loc_;
  int E_;
  int64_t spin_ns_;
  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> publishes_{0}, pairs_{0}, layers_run_{0}, skipped_{0}, busy_ns_{0};
};

// A prompt layer call's CPU job handed over with no Python thread between (engine/experts/cpu_jobs.py): post()
// checks the tasks and submits run_gather's job to the runner's pool from the calling thread, which returns at
// once, the pool's workers already on it; this object's thread waits for the job (running worker 0's share where
// the pool's caller joins), then stores `seq` into *flag when given (page-locked: the device's wait_flag reads
// it) and marks the job done; wait() returns when it began and how long it ran. One job at a time: post() waits
// for the last. From post() until the flag is up the runner is held (Runner::hold): a call on it from another
// thread waits rather than queueing its job in front of the flag. The job reads x and writes out until done: the
// caller keeps them.
class GatherJobs {
 public:
  explicit GatherJobs(Runner& runner) : r_(runner), thread_([this] { loop(); }) {}
  ~GatherJobs() {
    {
      std::lock_guard<std::mutex> lock(m_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  GatherJobs(const GatherJobs&) = delete;
  GatherJobs& operator=(const GatherJobs&) = delete;

  void post(const Table& t, const std::vector<int64_t>& experts, const std::vector<int64_t>& rows, uint64_t x,
            int x_fmt, int64_t x_stride, int T, uint64_t out, int out_fmt, int64_t out_stride, uint64_t flag,
            int64_t seq) {
    Format xf = Table::check_format(x_fmt), of = Table::check_format(out_fmt);
    Runner::check_gather(t, experts, rows, T);
    py::gil_scoped_release release;
    std::unique_lock<std::mutex> lock(m_);
    done_cv_.wait(lock, [&] { return done_ == posted_; });
    experts_ = experts;  // the job reads the addresses and rows until done
    rows_ = rows;
    {
      auto run = r_.hold();
      started_ = now();
      r_.submit_gather(t, experts_.size(), experts_.data(), rows_.data(), x, xf, x_stride, T, out, of, out_stride,
                       nullptr);
      r_.held_ = true;  // until loop() has raised the flag
    }
    flag_ = reinterpret_cast<int64_t*>(flag);
    seq_ = seq;
    ++posted_;
    lock.unlock();
    cv_.notify_one();
  }

  // -> (when the last posted job began, steady-clock ns; seconds it ran), once it is done.
  std::pair<int64_t, double> wait() {
    py::gil_scoped_release release;
    std::unique_lock<std::mutex> lock(m_);
    done_cv_.wait(lock, [&] { return done_ == posted_; });
    return {started_, seconds_};
  }

 private:
  void loop() {
    std::unique_lock<std::mutex> lock(m_);
    for (;;) {
      cv_.wait(lock, [&] { return stop_ || posted_ != done_; });
      if (posted_ == done_) return;  // stopped with nothing in flight
      int64_t* const flag = flag_;
      const int64_t seq = seq_;
      lock.unlock();
      int64_t end;
      {
        std::lock_guard<std::mutex> run(r_.mu_);  // the runner is held for this job (post): no waiting for free_
        r_.pool.wait();  // (a waiter with a core of its own spins: the flag goes up as the job ends)
        end = now();
        if (flag) __atomic_store_n(flag, seq, __ATOMIC_RELEASE);
        r_.held_ = false;
      }
      r_.free_.notify_all();
      lock.lock();
      seconds_ = (end - started_) * 1e-9;
      done_ = posted_;
      done_cv_.notify_all();
    }
  }

  Runner& r_;
  std::mutex m_;
  std::condition_variable cv_, done_cv_;
  uint64_t posted_ = 0, done_ = 0;
  bool stop_ = false;
  std::vector<int64_t> experts_, rows_;
  int64_t* flag_ = nullptr;
  int64_t seq_ = 0, started_ = 0;
  double seconds_ = 0;
  std::thread thread_;  // last: started once the rest is made
};

}  // namespace

PYBIND11_MODULE(_cpu_experts, m) {
  m.doc() = "killick native CPU expert kernels (SwiGLU experts on a pinned worker pool)";
  m.def("supported_isas", &supported_isas, "ISAs this machine and build can run, best first");
  m.def("physical_cpus", &physical_cpus, "one CPU id per physical core in the process's affinity mask");
  m.attr("FORMAT_F32") = int(kF32);
  m.attr("FORMAT_BF16") = int(kBF16);
  m.attr("MAX_TOKENS_PER_PASS") = kMaxTokens;
  m.attr("MAX_TILE_TOKENS") = kMaxTileTokens;
  py::class_<Table>(m, "Table")
      .def(py::init<int, int, int, uint64_t, int64_t, int64_t, uint64_t, int64_t, int64_t, int64_t>(),
           py::arg("fmt"), py::arg("H"), py::arg("I"), py::arg("gu_ptr"), py::arg("gu_expert_stride"),
           py::arg("gu_row_stride"), py::arg("dn_ptr"), py::arg("dn_expert_stride"), py::arg("dn_row_stride"),
           py::arg("E"));
  py::class_<Runner>(m, "Runner")
      .def(py::init<int, bool, int, int>(), py::arg("threads"), py::arg("pin") = true, py::arg("spin_us") = 2000,
           py::arg("caller_joins") = -1)
      .def_property_readonly("threads", [](Runner& r) { return r.pool.threads(); })
      .def_property_readonly("cpus", [](Runner& r) { return r.pool.cpus(); })
      .def_property_readonly("caller_joins", [](Runner& r) { return r.pool.caller_joins(); })
      .def_property("isa", [](Runner& r) { return r.isa; }, &Runner::set_isa)
      .def_readwrite("row_block", &Runner::row_block)
      .def_readwrite("claim_rows", &Runner::claim_rows)
      .def_readwrite("guided", &Runner::guided)
      .def_readwrite("least_claim", &Runner::least_claim)
      .def_readwrite("prefetch_hint", &Runner::prefetch_hint)
      .def_readwrite("prefetch_bytes", &Runner::prefetch_bytes)
      .def_readwrite("tile_tokens", &Runner::tile_tokens)
      .def_property_readonly("has_tiles", [](Runner& r) { return r.kernels->tile != nullptr; })
      .def_property_readonly("last_tiles", [](Runner& r) { return r.planner_last_tiles(); })
      .def("submit_moe", &Runner::submit_moe)
      .def("run_gather", &Runner::run_gather, py::arg("table"), py::arg("experts"), py::arg("rows"), py::arg("x"),
           py::arg("x_fmt"), py::arg("x_stride"), py::arg("T"), py::arg("out"), py::arg("out_fmt"),
           py::arg("out_stride"))
      .def("submit_table", &Runner::submit_table, py::arg("table"), py::arg("experts"), py::arg("tokens"),
           py::arg("weights"), py::arg("x"), py::arg("x_stride"), py::arg("y"), py::arg("y_stride"), py::arg("T"),
           py::arg("wait") = false)
      .def("set_profile", [](Runner& r, bool on) { py::gil_scoped_release release; r.pool.set_profile(on); },
           "start or stop timestamping jobs (the sums restart from zero); waits for the job in flight first")
      .def("profile", [](Runner& r) {
        PoolProfile p = r.pool.profile();
        py::dict d;
        d["jobs"] = p.jobs;
        d["wall_s"] = p.wall_s;
        d["dispatch_s"] = p.dispatch_s;
        d["run_s"] = p.run_s;
        d["barrier_s"] = p.barrier_s;
        d["tail_s"] = p.tail_s;
        d["wake_s"] = p.wake_s;
        d["run_phase_s"] = std::vector<double>(p.run_phase_s, p.run_phase_s + kMaxProfiledPhases);
        return d;
      }, "core-seconds of the profiled jobs waited on so far, by where they went (see PoolProfile)")
      .def("wait", [](Runner& r) { py::gil_scoped_release release; r.pool.wait(); })
      .def("done", [](Runner& r) { return r.pool.done(); })
      .def("read", &Runner::read, py::arg("p"), py::arg("nbytes"), py::arg("streams") = 1,
           py::arg("chunk_bytes") = 0);
  py::class_<GatherJobs>(m, "GatherJobs")
      .def(py::init<Runner&>(), py::keep_alive<1, 2>(), py::arg("runner"))
      .def("post", &GatherJobs::post, py::arg("table"), py::arg("experts"), py::arg("rows"), py::arg("x"),
           py::arg("x_fmt"), py::arg("x_stride"), py::arg("T"), py::arg("out"), py::arg("out_fmt"),
           py::arg("out_stride"), py::arg("flag") = 0, py::arg("seq") = 0)
      .def("wait", &GatherJobs::wait);
  py::class_<Mailbox>(m, "Mailbox")
      .def(py::init<Runner&, std::vector<Table>, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, int, uint64_t, int,
                    int, int, int, uint64_t, int, int>(),
           py::keep_alive<1, 2>(), py::arg("runner"), py::arg("tables"), py::arg("posted"), py::arg("done"),
           py::arg("meta"), py::arg("ids"), py::arg("x"), py::arg("x_fmt"), py::arg("out"), py::arg("out_fmt"),
           py::arg("H"), py::arg("KP"), py::arg("n_max"), py::arg("loc"), py::arg("E"), py::arg("spin_us") = 20000)
      .def("start", &Mailbox::start)
      .def("stop", [](Mailbox& mb) { py::gil_scoped_release release; mb.stop(); })
      .def_property_readonly("running", &Mailbox::running)
      .def("stats", [](const Mailbox& mb) {
        py::dict d;
        d["publishes"] = mb.publishes();
        d["pairs"] = mb.pairs();
        d["layers_run"] = mb.layers_run();
        d["busy_s"] = mb.busy_s();
        d["skipped"] = mb.skipped();
        return d;
      }, "publishes answered, CPU pairs and layers run, seconds spent running them, torn reads retried");
}
