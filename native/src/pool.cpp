#include "pool.h"

#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>

namespace killick {
namespace {

using Clock = std::chrono::steady_clock;

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// C stdio, not <fstream>: some Python builds link the extension with a static libstdc++ whose iostreams
// crash once torch has loaded the shared one (seen on the lent GPU box).
int read_int(const std::string& path) {
  int v = -1;
  if (FILE* f = std::fopen(path.c_str(), "r")) {
    if (std::fscanf(f, "%d", &v) != 1) v = -1;
    std::fclose(f);
  }
  return v;
}

void pin_to(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  sched_setaffinity(0, sizeof(set), &set);  // best effort: a refused pin only costs locality
}

}  // namespace

std::vector<int> physical_cpus() {
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  std::vector<int> out;
  if (sched_getaffinity(0, sizeof(allowed), &allowed) != 0) return out;
  std::set<std::pair<int, int>> seen;  // (package, core)
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (!CPU_ISSET(cpu, &allowed)) continue;
    std::string base = "/sys/devices/system/cpu/cpu" + std::to_string(cpu) + "/topology/";
    int core = read_int(base + "core_id"), pkg = read_int(base + "physical_package_id");
    if (core < 0) core = cpu;  // no sysfs topology: count every CPU as a core
    if (seen.insert({pkg, core}).second) out.push_back(cpu);
  }
  return out;
}

Pool::Pool(int threads, bool pin, int spin_us, int caller_joins) : spin_us_(spin_us) {
  if (threads < 1) throw std::invalid_argument("a pool needs at least one thread");
  threads_ = threads;
  std::vector<int> phys = physical_cpus();
  int n = int(phys.size());
  caller_joins_ = caller_joins < 0 ? threads >= n : caller_joins != 0;
  // With a core of its own (or as a worker itself) the caller spins through the whole job (up to 20 ms): a
  // parked thread in a VM can take hundreds of microseconds to wake, measured as a fixed cost per call.
  wait_spin_us_ = threads < n || caller_joins_ ? std::max(spin_us, 20000) : 0;
  // Pin only when every worker gets a core of its own; leave the first core to the caller if we can (when it
  // joins, that core is its own as worker 0).
  if (pin && threads <= n) {
    int skip = threads < n && !caller_joins_ ? 1 : 0;
    for (int i = 0; i < threads; ++i) cpus_.push_back(phys[(i + skip) % n]);
  }
  for (int i = caller_joins_ ? 1 : 0; i < threads; ++i) workers_.emplace_back([this, i] { worker_main(i); });
}

Pool::~Pool() {
  wait();
  stop_.store(true);
  generation_.fetch_add(1);
  { std::lock_guard<std::mutex> lock(park_mu_); }
  park_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void Pool::submit(std::shared_ptr<Job> job, std::function<void()> on_done) {
  wait();
  on_done_ = std::move(on_done);
  job_profiled_ = profile_on_ && job->phases() <= kMaxProfiledPhases;
  if (job_profiled_) submit_ns_ = now_ns();
  job_ = std::move(job);
  remaining_.store(threads(), std::memory_order_relaxed);
  generation_.fetch_add(1, std::memory_order_seq_cst);
  if (sleepers_.load(std::memory_order_seq_cst) > 0) {
    { std::lock_guard<std::mutex> lock(park_mu_); }
    park_cv_.notify_all();
  }
}

bool Pool::done() const {
  return finished_.load(std::memory_order_acquire) == generation_.load(std::memory_order_acquire);
}

void Pool::wait() {
  uint64_t gen = generation_.load(std::memory_order_acquire);
  uint64_t ran = caller_ran_.load(std::memory_order_relaxed);
  if (caller_joins_ && ran != gen && job_ && caller_ran_.compare_exchange_strong(ran, gen))
    run_job(0, gen, caller_sense_);
  auto until = Clock::now() + std::chrono::microseconds(wait_spin_us_);
  for (int i = 0; !done(); ++i) {
    if ((i & 255) == 0 && Clock::now() > until) break;
    cpu_relax();
  }
  std::unique_lock<std::mutex> lock(done_mu_);
  done_cv_.wait(lock, [this] { return done(); });
  if (job_ && job_profiled_) fold_profile(now_ns());
  job_.reset();
  on_done_ = nullptr;
}

void Pool::set_profile(bool on) {
  wait();
  profile_on_ = on;
  profile_ = PoolProfile{};
  stamps_.assign(size_t(threads_), Stamps{});
}

void Pool::fold_profile(int64_t woken_ns) {
  const int phases = job_->phases(), last = phases - 1;
  const double ns = 1e-9;
  int64_t last_end = 0;
  for (const Stamps& s : stamps_) last_end = std::max(last_end, s.end[last]);
  for (const Stamps& s : stamps_) {
    profile_.dispatch_s += (s.start[0] - submit_ns_) * ns;
    for (int p = 0; p < phases; ++p) {
      double run = (s.end[p] - s.start[p]) * ns;
      profile_.run_s += run;
      profile_.run_phase_s[p] += run;
      if (p > 0) profile_.barrier_s += (s.start[p] - s.end[p - 1]) * ns;
    }
    profile_.tail_s += (last_end - s.end[last]) * ns;
  }
  const double n = double(stamps_.size());
  profile_.wake_s += n * (woken_ns - last_end) * ns;
  profile_.wall_s += n * (woken_ns - submit_ns_) * ns;
  ++profile_.jobs;
}

uint64_t Pool::await_generation(uint64_t seen) {
  auto until = Clock::now() + std::chrono::microseconds(spin_us_);
  for (int i = 0;; ++i) {
    uint64_t g = generation_.load(std::memory_order_acquire);
    if (g != seen) return g;
    if ((i & 255) == 0 && Clock::now() > until) break;
    cpu_relax();
  }
  std::unique_lock<std::mutex> lock(park_mu_);
  sleepers_.fetch_add(1, std::memory_order_seq_cst);
  park_cv_.wait(lock, [&] { return generation_.load(std::memory_order_seq_cst) != seen; });
  sleepers_.fetch_sub(1, std::memory_order_relaxed);
  return generation_.load(std::memory_order_acquire);
}

void Pool::barrier(int& sense) {
  sense ^= 1;
  if (barrier_count_.fetch_add(1, std::memory_order_acq_rel) == threads() - 1) {
    barrier_count_.store(0, std::memory_order_relaxed);
    barrier_sense_.store(sense, std::memory_order_release);
    return;
  }
  // Workers are pinned one per core, so spinning is cheap; yield in case the pool is oversubscribed.
  for (int i = 0; barrier_sense_.load(std::memory_order_acquire) != sense; ++i) {
    if (i > 4000) sched_yield();
    else cpu_relax();
  }
}

void Pool::run_job(int index, uint64_t generation, int& sense) {
  Job* job = job_.get();
  int phases = job->phases();
  Stamps* st = job_profiled_ ? &stamps_[size_t(index)] : nullptr;
  for (int p = 0; p < phases; ++p) {
    if (st) st->start[p] = now_ns();
    job->run(p, index, threads());
    if (st) st->end[p] = now_ns();
    if (p + 1 < phases) barrier(sense);
  }
  if (remaining_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
    if (on_done_) on_done_();  // no submit() can replace it before finished_ moves on
    {
      std::lock_guard<std::mutex> lock(done_mu_);
      finished_.store(generation, std::memory_order_release);
    }
    done_cv_.notify_all();
  }
}

void Pool::worker_main(int index) {
  if (index < int(cpus_.size())) pin_to(cpus_[index]);
  uint64_t seen = 0;
  int sense = 0;
  for (;;) {
    seen = await_generation(seen);
    if (stop_.load()) return;
    run_job(index, seen, sense);
  }
}

}  // namespace killick
