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
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <utility>

namespace shardlm {

class Team {
 public:
  explicit Team(int64_t size) : size_(size) {}

  int64_t size() const { return size_; }

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
