// Splitting a kernel's independent items over XLA's intra-op thread pool (the FFI ThreadPool
// context): the calling thread takes items too, helpers take them from an atomic counter, and the
// caller waits only for helpers that already started one, so a busy pool costs parallelism, never a
// stall, and two kernels running at once on a small pool cannot deadlock.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace hk {

// At most this many threads per call when a call leaves the count to the pool (threads <= 0); 0: no
// cap. Set from Python (hk_set_thread_cap) while other processes keep this machine's cores busy
// (hkserve/kernels/contention.py): a helper sharing a core with them starts late, and the work it
// would have taken then waits on the calling thread anyway.
inline std::atomic<int>& thread_cap() {
  static std::atomic<int> cap{0};
  return cap;
}

// The threads a call uses: its own fixed count, else the pool's, within the cap.
inline int64_t call_threads(ffi::ThreadPool& pool, int64_t threads) {
  if (threads > 0) return threads;
  int64_t n = std::max<int64_t>(1, pool.num_threads()), cap = thread_cap().load(std::memory_order_relaxed);
  return cap > 0 ? std::min(n, cap) : n;
}

// Shared by the caller and the helper tasks it schedules; helpers hold it alive by shared_ptr, so a
// helper that starts after the call returned touches only this, finds it closed, and leaves.
struct Work {
  std::atomic<int64_t> next{0};
  std::atomic<int> active{0};
  std::atomic<bool> closed{false};
};

// Adjacent tiles a work item takes (parallel_runs). Where a product has many tiles (Gemma 3's 262,144-
// column head: 4,096 tiles of 40 KB, 168 MB a call) each item is a run of about 2 MiB (51 tiles), so a
// thread streams long stretches of the weight (its prefetches 4 KiB ahead land in its own next tile, not
// in one the other thread takes) and the shared counter moves 80 times a call instead of 4,096; a run is
// short enough (~0.1 ms) that a helper preempted in one delays the call little more than it would in a
// tile. Batch-1 head A/B (scripts/head_ab.py, docs/benchmarks.md): runs reached 2.9 ms a call, tile by tile
// never below 4.0. Runs of under a MiB (every layer product here: too few tiles) stay single tiles.
inline int64_t tile_run(int64_t tiles, int64_t tile_bytes, int64_t threads) {
  int64_t run = std::min((int64_t{2} << 20) / tile_bytes, tiles / (8 * threads));
  return run * tile_bytes >= (int64_t{1} << 20) ? run : 1;
}

template <typename F>
inline void parallel_tiles(ffi::ThreadPool& pool, int64_t tiles, int64_t threads, const F& body) {
  int64_t helpers = std::min<int64_t>(threads - 1, tiles - 1);
  if (helpers <= 0) {
    for (int64_t t = 0; t < tiles; ++t) body(t);
    return;
  }
  auto work = std::make_shared<Work>();
  auto drain = [work, tiles, &body] {
    for (int64_t t; (t = work->next.fetch_add(1)) < tiles;) body(t);
  };
  for (int64_t h = 0; h < helpers; ++h) {
    pool.Schedule([work, drain] {
      work->active.fetch_add(1);
      if (!work->closed.load()) drain();
      work->active.fetch_sub(1);
    });
  }
  drain();
  work->closed.store(true);
  for (int spins = 0; work->active.load() != 0; ++spins) {  // only helpers already running a tile
    if (spins > 1000) std::this_thread::yield();
  }
}

// parallel_tiles over runs of `run` adjacent items: body(t) for every t < items, a run on one thread, in
// order.
template <typename F>
inline void parallel_runs(ffi::ThreadPool& pool, int64_t items, int64_t run, int64_t threads, const F& body) {
  parallel_tiles(pool, (items + run - 1) / run, threads, [&body, items, run](int64_t item) {
    for (int64_t t = item * run, last = std::min(items, t + run); t < last; ++t) body(t);
  });
}

}  // namespace hk
