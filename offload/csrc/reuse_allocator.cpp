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
#ifndef _GNU_SOURCE
#define _GNU_SOURCE  // mremap
#endif
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <map>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {

constexpr size_t kPage = 4096;

struct ReuseAllocator final : c10::Allocator {
  c10::Allocator* base = nullptr;  // the allocator this one was installed over
  size_t min_bytes = 1 << 20;
  size_t slack = 32u << 20;
  std::mutex mu;
  std::multimap<size_t, void*> kept;  // freed mappings by size
  std::unordered_map<void*, std::pair<size_t, size_t>> live_chunks;  // -> (mapped size, requested)
  size_t live = 0, live_peak = 0, mapped = 0, mapped_peak = 0, cached = 0;  // live: requested bytes
  uint64_t hits = 0, resizes = 0, misses = 0, unmaps = 0;

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
        p = it->second;
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
          donor = {pick->second, pick->first};
          cached -= pick->first;
          mapped -= pick->first;
          kept.erase(pick);
          ++resizes;
        } else {
          ++misses;
        }
        while (!kept.empty() && mapped + want > bound) {
          auto last = std::prev(kept.end());
          drop.emplace_back(last->second, last->first);
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
    kept.emplace(size, p);
    cached += size;
    return true;
  }

  void trim() {
    std::vector<std::pair<void*, size_t>> drop;
    {
      std::lock_guard<std::mutex> g(mu);
      for (auto& kv : kept) drop.emplace_back(kv.second, kv.first);
      kept.clear();
      mapped -= cached;
      unmaps += drop.size();
      cached = 0;
      live_peak = live;
      mapped_peak = mapped;
    }
    for (auto& d : drop) munmap(d.first, d.second);
  }

  c10::DeleterFnPtr raw_deleter() const override { return &ReuseAllocator::free_any; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
};

ReuseAllocator g_alloc;

// Every buffer this allocator handed out, its own or the base allocator's (raw_deallocate
// callers reach this deleter for both).
void ReuseAllocator::free_any(void* p) {
  if (p != nullptr && !g_alloc.keep(p)) g_alloc.base->raw_deleter()(p);
}

}  // namespace

extern "C" {

// Install over torch's current CPU allocator (or update the settings when installed already).
int omnidit_reuse_install(size_t min_bytes, size_t slack) {
  std::lock_guard<std::mutex> g(g_alloc.mu);
  if (g_alloc.base == nullptr) {
    c10::Allocator* current = c10::GetCPUAllocator();
    if (current == &g_alloc) return 0;
    g_alloc.base = current;
  }
  g_alloc.min_bytes = min_bytes;
  g_alloc.slack = slack;
  c10::SetCPUAllocator(&g_alloc, /*priority=*/100);
  return 1;
}

// Unmap every kept mapping now (live buffers stay); the peaks restart from what is live.
void omnidit_reuse_trim() { g_alloc.trim(); }

// hits, resizes, misses, unmaps, cached, live, live_peak, mapped, mapped_peak, min_bytes, slack
void omnidit_reuse_stats(uint64_t* out) {
  std::lock_guard<std::mutex> g(g_alloc.mu);
  const uint64_t v[] = {g_alloc.hits, g_alloc.resizes, g_alloc.misses, g_alloc.unmaps, g_alloc.cached, g_alloc.live,
                        g_alloc.live_peak, g_alloc.mapped, g_alloc.mapped_peak, g_alloc.min_bytes,
                        g_alloc.slack};
  std::copy(std::begin(v), std::end(v), out);
}

}  // extern "C"
