// A persistent pool of worker threads pinned to physical cores. One job at a time; a job is a fixed
// number of phases with a barrier between them. Workers spin briefly after a job, then park.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
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

// CPU ids, one per physical core (first hardware thread of each core) the process may run on.
std::vector<int> physical_cpus();

class Pool {
 public:
  Pool(int threads, bool pin, int spin_us);
  ~Pool();
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  void submit(std::shared_ptr<Job> job);  // waits for the job in flight first
  void wait();                            // blocks until the last submitted job finished
  bool done() const;
  int threads() const { return int(workers_.size()); }
  const std::vector<int>& cpus() const { return cpus_; }

 private:
  void worker_main(int index);
  uint64_t await_generation(uint64_t seen);
  void barrier(int& sense);

  std::vector<std::thread> workers_;
  std::vector<int> cpus_;
  int spin_us_;
  int wait_spin_us_;  // the caller spins only when the pool leaves it a core of its own
  std::shared_ptr<Job> job_;
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
