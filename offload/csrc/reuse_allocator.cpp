// omnidit's reuse allocator for CPU tensors (see offload/reuse.py).
//
// Large buffers (>= min_bytes) get their own anonymous mapping, as under a fixed glibc mmap
// threshold, so the process keeps no heap holes; but a freed mapping is kept, resident, for the
// next request of up to its size and down to half of it (the same shapes recur block after
// block and step after step, so most requests find one). A request that finds none maps afresh
// while everything mapped stays within the largest total ever requested at once plus `slack`
// bytes; beyond that it resizes a kept mapping with mremap (its pages stay, only a new tail
// faults in) and unmaps others, largest first, until the total fits. A forward thus stops
// paying a page fault per 4 KiB of every activation. Smaller buffers go to the allocator that
// was there.
//
// A kept mapping not reused within `idle_s` seconds of being freed is unmapped by a sweeper
// thread (started at install), so the memory a large request left behind goes back to the
// system once it stops recurring; when no large buffer was allocated or freed for `idle_s`, the
// peaks restart from what is live (as after a trim), so the bound follows today's traffic, not
// the largest request ever served. idle_s = 0 keeps mappings until a miss needs the room.
#ifndef _GNU_SOURCE
#define _GNU_SOURCE  // mremap
#endif
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <map>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {

constexpr size_t kPage = 4096;
using Clock = std::chrono::steady_clock;

struct Kept {
  void* p;
  Clock::time_point freed;  // when it was last given back (the sweeper unmaps it idle_s later)
};

struct ReuseAllocator final : c10::Allocator {
  c10::Allocator* base = nullptr;  // the allocator this one was installed over
  size_t min_bytes = 1 << 20;
  size_t slack = 32u << 20;
  double idle_s = 5.0;  // a kept mapping unused this long is unmapped; 0: never
  std::mutex mu;
  std::condition_variable sweep_wake;  // settings changed, or the first mapping was kept
  pid_t sweeper_pid = 0;  // the process whose sweeper thread runs (none in a forked child)
  std::multimap<size_t, Kept> kept;  // freed mappings by size
  std::unordered_map<void*, std::pair<size_t, size_t>> live_chunks;  // -> (mapped size, requested)
  size_t live = 0, live_peak = 0, mapped = 0, mapped_peak = 0, cached = 0;  // live: requested bytes
  uint64_t hits = 0, resizes = 0, misses = 0, unmaps = 0, idle_unmaps = 0;
  Clock::time_point last_activity = Clock::now();  // the last large allocation or free

  c10::DataPtr allocate(size_t n) override {
    if (n < min_bytes) return base->allocate(n);
    const size_t want = (n + kPage - 1) / kPage * kPage;
    void* p = nullptr;
    std::pair<void*, size_t> donor{nullptr, 0};  // a kept mapping resized to `want` (mremap)
    std::vector<std::pair<void*, size_t>> drop;
    size_t size = want;
    {
      std::lock_guard<std::mutex> g(mu);
      auto it = kept.lower_bound(want);  // the smallest kept size that fits ...
      if (it != kept.end()) it = std::prev(kept.upper_bound(it->first));  // ... its latest freed (LIFO)
      if (it != kept.end() && it->first <= 2 * want) {  // a kept mapping up to twice the size
        size = it->first;
        p = it->second.p;
        kept.erase(it);
        cached -= size;
        ++hits;
      } else {
        // No close fit. Within the bound (the live peak plus the slack) map afresh, so that every
        // size keeps its mappings; over it, resize a kept mapping rather than unmap it and map
        // anew (its pages stay, only the new tail faults in): the largest below the size, or else
        // the smallest above; then unmap other kept mappings (largest first) until all fits.
        const size_t bound = std::max(live_peak, live + want) + slack;
        auto below = kept.lower_bound(want);
        auto pick = below != kept.begin() ? std::prev(below) : below;
        if (mapped + want > bound && pick != kept.end()) {
          donor = {pick->second.p, pick->first};
          cached -= pick->first;
          mapped -= pick->first;
          kept.erase(pick);
          ++resizes;
        } else {
          ++misses;
        }
        while (!kept.empty() && mapped + want > bound) {
          auto last = std::prev(kept.end());
          drop.emplace_back(last->second.p, last->first);
          mapped -= last->first;
          cached -= last->first;
          kept.erase(last);
          ++unmaps;
        }
        mapped += want;  // reserved before the call, so concurrent requests see it
        mapped_peak = std::max(mapped_peak, mapped);
      }
    }
    for (auto& d : drop) munmap(d.first, d.second);
    if (donor.first != nullptr) {
      p = mremap(donor.first, donor.second, want, MREMAP_MAYMOVE);
      if (p == MAP_FAILED) {
        munmap(donor.first, donor.second);
        p = nullptr;
      }
    }
    if (p == nullptr) {
      p = mmap(nullptr, want, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p == MAP_FAILED) {
        std::lock_guard<std::mutex> g(mu);
        mapped -= want;
        TORCH_CHECK_WITH(OutOfMemoryError, false, "omnidit reuse allocator: mmap of ", want, " bytes failed");
      }
    }
    {
      std::lock_guard<std::mutex> g(mu);
      live_chunks.emplace(p, std::make_pair(size, want));
      live += want;
      live_peak = std::max(live_peak, live);
      last_activity = Clock::now();
    }
    return {p, p, &ReuseAllocator::free_any, c10::Device(c10::DeviceType::CPU)};
  }

  static void free_any(void* p);

  bool keep(void* p) {
    std::lock_guard<std::mutex> g(mu);
    auto it = live_chunks.find(p);
    if (it == live_chunks.end()) return false;
    const size_t size = it->second.first;
    live -= it->second.second;
    live_chunks.erase(it);
    const bool first = kept.empty();
    last_activity = Clock::now();
    kept.emplace(size, Kept{p, last_activity});
    cached += size;
    if (first) sweep_wake.notify_one();  // the sweeper waits without a deadline while none is kept
    return true;
  }

  void trim() {
    std::vector<std::pair<void*, size_t>> drop;
    {
      std::lock_guard<std::mutex> g(mu);
      for (auto& kv : kept) drop.emplace_back(kv.second.p, kv.first);
      kept.clear();
      mapped -= cached;
      unmaps += drop.size();
      cached = 0;
      live_peak = live;
      mapped_peak = mapped;
    }
    for (auto& d : drop) munmap(d.first, d.second);
  }

  // The sweeper thread: unmaps kept mappings idle for idle_s, and restarts the peaks once no large
  // buffer was allocated or freed for idle_s. It sleeps until the next such deadline (without one
  // while nothing is kept and the peaks are current), and never touches Python.
  void sweep_forever() {
    std::unique_lock<std::mutex> g(mu);
    for (;;) {
      if (idle_s <= 0) {
        sweep_wake.wait(g);
        continue;
      }
      const auto limit = std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(idle_s));
      const auto now = Clock::now();
      std::vector<std::pair<void*, size_t>> drop;
      auto next = Clock::time_point::max();
      for (auto it = kept.begin(); it != kept.end();) {
        if (now - it->second.freed >= limit) {
          drop.emplace_back(it->second.p, it->first);
          mapped -= it->first;
          cached -= it->first;
          it = kept.erase(it);
        } else {
          next = std::min(next, it->second.freed + limit);
          ++it;
        }
      }
      unmaps += drop.size();
      idle_unmaps += drop.size();
      if (now - last_activity >= limit) {  // quiet: the peaks restart from what is live
        live_peak = live;
        mapped_peak = mapped;
      } else if (live_peak > live || mapped_peak > mapped) {
        next = std::min(next, last_activity + limit);
      }
      if (!drop.empty()) {
        g.unlock();
        for (auto& d : drop) munmap(d.first, d.second);
        g.lock();
        continue;  // the state may have moved while unlocked
      }
      if (next == Clock::time_point::max()) {
        sweep_wake.wait(g);
      } else {
        sweep_wake.wait_until(g, next);
      }
    }
  }

  c10::DeleterFnPtr raw_deleter() const override { return &ReuseAllocator::free_any; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
};

// Never destroyed: buffers freed during interpreter shutdown still reach it, and the sweeper
// thread may still be waiting on its members when static destructors run.
ReuseAllocator& g_alloc = *new ReuseAllocator;

// Every buffer this allocator handed out, its own or the base allocator's (raw_deallocate
// callers reach this deleter for both).
void ReuseAllocator::free_any(void* p) {
  if (p != nullptr && !g_alloc.keep(p)) g_alloc.base->raw_deleter()(p);
}

}  // namespace

extern "C" {

// Install over torch's current CPU allocator (or update the settings when installed already),
// and start the sweeper thread where this process has none (first install, or a forked child).
// Returns 1, or -1 (nothing installed) when the thread cannot be started.
int omnidit_reuse_install(size_t min_bytes, size_t slack, double idle_s) {
  std::lock_guard<std::mutex> g(g_alloc.mu);
  if (g_alloc.sweeper_pid != getpid()) {
    try {
      std::thread([] { g_alloc.sweep_forever(); }).detach();
    } catch (const std::exception&) {
      return -1;
    }
    g_alloc.sweeper_pid = getpid();
  }
  if (g_alloc.base == nullptr) g_alloc.base = c10::GetCPUAllocator();
  g_alloc.min_bytes = min_bytes;
  g_alloc.slack = slack;
  g_alloc.idle_s = idle_s;
  c10::SetCPUAllocator(&g_alloc, /*priority=*/100);
  g_alloc.sweep_wake.notify_one();  // new settings: new deadlines
  return 1;
}

// Unmap every kept mapping now (live buffers stay); the peaks restart from what is live.
void omnidit_reuse_trim() { g_alloc.trim(); }

// hits, resizes, misses, unmaps, cached, live, live_peak, mapped, mapped_peak, min_bytes, slack,
// idle_unmaps, idle_ms
void omnidit_reuse_stats(uint64_t* out) {
  std::lock_guard<std::mutex> g(g_alloc.mu);
  const uint64_t v[] = {g_alloc.hits, g_alloc.resizes, g_alloc.misses, g_alloc.unmaps, g_alloc.cached, g_alloc.live,
                        g_alloc.live_peak, g_alloc.mapped, g_alloc.mapped_peak, g_alloc.min_bytes,
                        g_alloc.slack, g_alloc.idle_unmaps, static_cast<uint64_t>(g_alloc.idle_s * 1000.0 + 0.5)};
  std::copy(std::begin(v), std::end(v), out);
}

}  // extern "C"
