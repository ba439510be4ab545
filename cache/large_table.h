// Private to the cache manager's sources: LargeTable<T>, a std::vector for the manager's big per-key and
// per-node tables, backed by transparent huge pages where the kernel offers them.
#pragma once

#include <cstddef>
#include <cstdlib>
#include <memory>
#include <new>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace kvtier::cache {

// An index of a million blocks keeps tables of megabytes (the key index, the use history, the nodes) that every
// admission reads at random places, one or more per block. With 4 KiB pages most of those reads also miss the
// TLB; asking for 2 MiB pages (madvise(MADV_HUGEPAGE), honoured where transparent huge pages are set to "always"
// or "madvise", a hint elsewhere) makes the page walk rare. Allocations under one huge page go to the standard
// allocator, as do all of them on systems without madvise.
template <class T>
class LargeTableAllocator {
 public:
  using value_type = T;
  static constexpr std::size_t kHugePage = std::size_t{2} << 20;

  LargeTableAllocator() noexcept = default;
  template <class U>
  LargeTableAllocator(const LargeTableAllocator<U>&) noexcept {}

  T* allocate(std::size_t n) {
    const std::size_t bytes = n * sizeof(T);
    if (!huge(bytes)) return std::allocator<T>().allocate(n);
    void* p = std::aligned_alloc(kHugePage, rounded(bytes));
    if (p == nullptr) throw std::bad_alloc();
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    (void)madvise(p, rounded(bytes), MADV_HUGEPAGE);  // a hint: without it the table still works on 4 KiB pages
#endif
    return static_cast<T*>(p);
  }
  void deallocate(T* p, std::size_t n) noexcept {
    if (!huge(n * sizeof(T)))
      std::allocator<T>().deallocate(p, n);
    else
      std::free(p);
  }
  template <class U>
  bool operator==(const LargeTableAllocator<U>&) const noexcept {
    return true;
  }

 private:
  static bool huge(std::size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    return bytes >= kHugePage;
#else
    (void)bytes;
    return false;
#endif
  }
  static std::size_t rounded(std::size_t bytes) { return (bytes + kHugePage - 1) / kHugePage * kHugePage; }
};

template <class T>
using LargeTable = std::vector<T, LargeTableAllocator<T>>;

}  // namespace kvtier::cache
