// The runner's own threads: Mailbox, a graphed decode step's CPU share, and GatherJobs, a prompt layer call's CPU
// job raised as a flag the device waits on (a thread of its own only where the pool's caller joins). Included
// by module.cpp alone.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "runner.h"

namespace killick {
namespace {

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
// once, the pool's workers already on it. The worker that finishes the job's last share ends it there and then
// (finish): it stores `seq` into *flag when given (page-locked: the device's wait_flag reads it) and marks the
// job done, with no thread to wake for either; wait() returns when it began and how long it ran. Where the pool's
// caller joins, this object's thread is that caller: it runs worker 0's share, and the runner is given back and
// the job marked done after that thread has left the pool's wait. One job at a time: post() waits for the last.
// From post() until the flag is up the runner is held (Runner::hold): a call on it from another thread waits
// rather than queueing its job in front of the flag. The job reads x and writes out until done: the caller
// keeps them.
class GatherJobs {
 public:
  explicit GatherJobs(Runner& runner) : r_(runner), joins_(runner.pool.caller_joins()) {
    if (joins_) thread_ = std::thread([this] { loop(); });
  }
  ~GatherJobs() {
    {
      std::unique_lock<std::mutex> lock(m_);
      done_cv_.wait(lock, [&] { return done_ == posted_; });  // finish() touches this object until then
      stop_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
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
    flag_ = reinterpret_cast<int64_t*>(flag);
    seq_ = seq;
    ++posted_;  // finish() takes m_ after this returns
    {
      auto run = r_.hold();
      started_ = now();
      r_.submit_gather(t, experts_.size(), experts_.data(), rows_.data(), x, xf, x_stride, T, out, of, out_stride,
                       nullptr, [this] { finish(); });
      r_.held_ = true;  // until finish() (or loop(), where the caller joins) gives it back
    }
    lock.unlock();
    if (joins_) cv_.notify_one();
  }

  // -> (when the last posted job began, steady-clock ns; seconds it ran), once it is done. (The pool counts it
  // waited on, in its profile, at the runner's next wait: Pool::set_profile.)
  std::pair<int64_t, double> wait() {
    py::gil_scoped_release release;
    std::unique_lock<std::mutex> lock(m_);
    done_cv_.wait(lock, [&] { return done_ == posted_; });
    return {started_, (end_ - started_) * 1e-9};
  }

 private:
  // On the worker that ends the job, before the pool counts it done. flag_ and seq_ stand: post() set them
  // before submitting and waits for this job to be done before setting them again.
  void finish() {
    end_ = now();
    if (flag_) __atomic_store_n(flag_, seq_, __ATOMIC_RELEASE);
    if (joins_) return;  // loop() gives the runner back once out of the pool's wait
    {
      std::lock_guard<std::mutex> run(r_.mu_);  // post() has let go of it: held_ was set under it
      r_.held_ = false;
    }
    r_.free_.notify_all();
    std::lock_guard<std::mutex> lock(m_);
    done_ = posted_;
    done_cv_.notify_all();  // under m_: once done_ is seen, this object may be destroyed
  }

  // Where the caller joins: worker 0's share of each posted job, then the runner given back.
  void loop() {
    std::unique_lock<std::mutex> lock(m_);
    for (;;) {
      cv_.wait(lock, [&] { return stop_ || ran_ != posted_; });
      if (ran_ == posted_) return;  // stopped with nothing in flight
      ran_ = posted_;
      lock.unlock();
      {
        std::lock_guard<std::mutex> run(r_.mu_);  // the runner is held for this job (post): no waiting for free_
        r_.pool.wait();
        r_.held_ = false;
      }
      r_.free_.notify_all();
      lock.lock();
      done_ = posted_;
      done_cv_.notify_all();
    }
  }

  Runner& r_;
  const bool joins_;
  std::mutex m_;
  std::condition_variable cv_, done_cv_;
  uint64_t posted_ = 0, done_ = 0, ran_ = 0;
  bool stop_ = false;
  std::vector<int64_t> experts_, rows_;
  int64_t* flag_ = nullptr;
  int64_t seq_ = 0, started_ = 0, end_ = 0;
  std::thread thread_;
};

}  // namespace
}  // namespace killick
