// The threads of one decode step as a team: one parallel region for the whole step, with a spinning barrier
// between its phases, instead of a fork and join per product.
//
// A one-rank decode step of the bundled model ran ~150 OpenMP parallel regions (five a block); each cost the
// calling thread about 1.1-1.4 us of fork and join on this VM (an empty at::parallel_for, measured) and, in a real
// step, about 2.8 us of waiting in libgomp (perf: 13 % of the driving thread's samples at int4 batch 1, while the
// other thread spent 37 % of its samples waiting). Two threads meeting at an atomic counter take about 0.3 us.
// A thread that waits spins briefly, then yields its core (a server or client process may need it), and gives up
// when another thread of the team has failed, so an exception cannot leave a thread waiting for ever.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace shardlm {

// Where the fused decode step's threads spend their time, phase by phase: seconds of work before each phase's
// barrier and of waiting in it, per thread, summed over steps. Off unless turned on (kernels.cpp's step_phases,
// bench/step_phases.py); a step reads the switch once, and with it off a barrier costs one branch more. Read and
// reset only while no step runs.
struct PhaseClock {
  static constexpr int THREADS = 64, PHASES = 8;
  std::atomic<bool> on{false};
  double work[THREADS][PHASES] = {}, wait[THREADS][PHASES] = {};
  double region = 0;  // seconds inside the steps' parallel regions, as the calling thread saw them
  int64_t steps = 0;

  static double now() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  }
  void reset() {
    for (int t = 0; t < THREADS; ++t)
      for (int p = 0; p < PHASES; ++p) work[t][p] = wait[t][p] = 0;
    region = 0, steps = 0;
  }
};

inline PhaseClock& phase_clock() {
  static PhaseClock clock;
  return clock;
}

class Team {
 public:
  explicit Team(int64_t size)
      : size_(size), timed_(phase_clock().on.load(std::memory_order_relaxed) && size <= PhaseClock::THREADS) {
    if (timed_) marks_.assign(size_ * 8, 0.0);  // a line apart: each thread writes its own
  }

  int64_t size() const { return size_; }
  bool timed() const { return timed_; }

  // Thread tid starts its work (the phase clock's first mark).
  void start(int64_t tid) {
    if (timed_) marks_[tid * 8] = PhaseClock::now();
  }

  // sync(), with the time since thread tid's last mark counted as phase `phase`'s work and the wait as its wait
  // (when the phase clock is on).
  bool sync(int64_t tid, int phase) {
    if (!timed_) return sync();
    PhaseClock& clock = phase_clock();
    const double arrived = PhaseClock::now();
    const bool ok = sync();
    const double left = PhaseClock::now();
    clock.work[tid][phase] += arrived - marks_[tid * 8];
    clock.wait[tid][phase] += left - arrived;
    marks_[tid * 8] = left;
    return ok;
  }

  // Wait until every thread of the team has arrived; false when a thread has failed (stop working then).
  bool sync() {
    if (size_ == 1) return !failed_.load(std::memory_order_relaxed);
    const int64_t gen = generation_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) == size_ - 1) {
      arrived_.store(0, std::memory_order_relaxed);
      generation_.store(gen + 1, std::memory_order_release);
    } else {
      for (int64_t spins = 0; generation_.load(std::memory_order_acquire) == gen; ++spins) {
        if (failed_.load(std::memory_order_relaxed)) return false;
        if (spins < SPINS)
          _mm_pause();
        else
          std::this_thread::yield();
      }
    }
    return !failed_.load(std::memory_order_acquire);
  }

  // Record the first exception of any thread and release the others from their waits.
  void fail(std::exception_ptr e) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!error_) error_ = e;
    }
    failed_.store(true, std::memory_order_release);
  }

  // After the region: rethrow the first thread's exception, if any.
  void rethrow() const {
    if (error_) std::rethrow_exception(error_);
  }

 private:
  static constexpr int64_t SPINS = 4000;  // about 0.1 ms of pause instructions, then yield
  int64_t size_;
  bool timed_;
  std::vector<double> marks_;  // thread t's last mark at [8 t]
  alignas(64) std::atomic<int64_t> arrived_{0};
  alignas(64) std::atomic<int64_t> generation_{0};
  alignas(64) std::atomic<bool> failed_{false};
  std::mutex mutex_;
  std::exception_ptr error_;
};

// Thread tid's part [lo, hi) of `units` split `parts` ways in consecutive runs of `chunk` (a multiple of `align`).
inline std::pair<int64_t, int64_t> share_of(int64_t units, int64_t tid, int64_t parts, int64_t align = 1) {
  int64_t chunk = (units + parts - 1) / parts;
  chunk = (chunk + align - 1) / align * align;
  const int64_t lo = std::min(units, tid * chunk);
  return {lo, std::min(units, lo + chunk)};
}

}  // namespace shardlm
