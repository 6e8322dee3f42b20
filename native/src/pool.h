// A persistent pool of worker threads pinned to physical cores. One job at a time; a job is a fixed
// number of phases with a barrier between them. Workers spin briefly after a job, then park.
// When the pool takes every core, the caller's own thread is worker 0 (caller_joins): it runs its share in
// wait(), so no core is left to wake the caller on (a parked caller took ~100 us a job to get a core back
// from spinning workers on a 2-core VM); the job then finishes only inside wait().
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace killick {

class Job {
 public:
  virtual ~Job() = default;
  virtual int phases() const = 0;
  // Called once per (phase, worker); workers split the phase's work among themselves by index.
  virtual void run(int phase, int worker, int workers) = 0;
};

// Where a pool's core-time went, summed over profiled jobs (Pool::set_profile). Per job and worker, the
// wall time from submit() to the caller's return from wait() splits into: dispatch (submit until the worker
// starts), run (inside Job::run, every phase), barrier (waiting for the others between phases), tail
// (after its last phase until the last worker's), and wake (last worker done until wait() returns).
// Jobs of more than kMaxProfiledPhases phases are not profiled.
constexpr int kMaxProfiledPhases = 3;
struct PoolProfile {
  uint64_t jobs = 0;
  double wall_s = 0, dispatch_s = 0, run_s = 0, barrier_s = 0, tail_s = 0, wake_s = 0;  // core-seconds
  double run_phase_s[kMaxProfiledPhases] = {0, 0, 0};  // run_s by phase
};

// CPU ids, one per physical core (first hardware thread of each core) the process may run on.
std::vector<int> physical_cpus();

class Pool {
 public:
  // caller_joins: 1 yes, 0 no, -1 when threads >= the physical cores this process may run on.
  Pool(int threads, bool pin, int spin_us, int caller_joins = -1);
  ~Pool();
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  // Waits for the job in flight first. on_done, when given, runs once on the thread that finishes the job's
  // last share, before done() turns true and wait() returns: what must happen the moment the job ends (a
  // flag the device waits on) happens there, with no other thread to wake for it.
  void submit(std::shared_ptr<Job> job, std::function<void()> on_done = {});
  void wait();  // blocks until the last submitted job finished (running worker 0's share if the caller joins)
  bool done() const;
  int threads() const { return threads_; }
  bool caller_joins() const { return caller_joins_; }
  const std::vector<int>& cpus() const { return cpus_; }
  // Timestamps every worker's phases from the next submit() on; profile() sums the jobs waited on since.
  void set_profile(bool on);
  PoolProfile profile() const { return profile_; }

 private:
  void worker_main(int index);
  void run_job(int index, uint64_t generation, int& sense);  // one worker's phases of the current job
  uint64_t await_generation(uint64_t seen);
  void barrier(int& sense);
  void fold_profile(int64_t woken_ns);

  struct alignas(64) Stamps {  // one worker's, on its own line: start and end of each phase (ns)
    int64_t start[kMaxProfiledPhases], end[kMaxProfiledPhases];
  };

  std::vector<std::thread> workers_;  // worker indices 1.. when the caller joins, else 0..
  std::vector<int> cpus_;  // worker index -> CPU it is pinned to (empty: not pinned; the caller never is)
  int threads_;
  bool caller_joins_;
  int caller_sense_ = 0;                    // the caller's barrier sense (caller_joins_)
  std::atomic<uint64_t> caller_ran_{0};     // the last generation whose worker-0 share a caller took
  int spin_us_;
  int wait_spin_us_;  // the caller spins only with a core of its own (the pool leaves it one, or it joins)
  std::shared_ptr<Job> job_;
  std::function<void()> on_done_;  // the current job's (submit)
  bool profile_on_ = false;  // set between jobs only (set_profile waits first)
  bool job_profiled_ = false;
  int64_t submit_ns_ = 0;
  std::vector<Stamps> stamps_;
  PoolProfile profile_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<uint64_t> finished_{0};
  std::atomic<int> remaining_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<bool> stop_{false};
  std::mutex park_mu_;
  std::condition_variable park_cv_;
  std::mutex done_mu_;
  std::condition_variable done_cv_;
  // Padding, not alignas: the pool must not be an over-aligned type (bound objects get plain new).
  char pad0_[64];
  std::atomic<int> barrier_count_{0};
  char pad1_[64];
  std::atomic<int> barrier_sense_{0};
  char pad2_[64];
};

}  // namespace killick
