// Uninitialised arrays whose first element starts a cache line (64 bytes).
// The kernels load their operands in vectors: a row that starts on a line
// keeps each load within one line, where `new T[]` (16-byte alignment)
// leaves a 64-byte row across two.
#pragma once

#include <cstddef>
#include <memory>
#include <new>

namespace attnx {

constexpr std::size_t kCacheLineBytes = 64;

template <typename T>
struct CacheLineDelete {
  void operator()(T* p) const { ::operator delete[](p, std::align_val_t(kCacheLineBytes)); }
};

template <typename T>
using CacheLineArray = std::unique_ptr<T[], CacheLineDelete<T>>;

template <typename T>
CacheLineArray<T> cache_line_array(std::size_t size) {
  return CacheLineArray<T>(
      static_cast<T*>(::operator new[](size * sizeof(T), std::align_val_t(kCacheLineBytes))));
}

}  // namespace attnx
