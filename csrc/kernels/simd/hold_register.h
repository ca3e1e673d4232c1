// hold_in_register: keeps a loaded vector in a register for the uses that
// follow.
//
// GCC folds a vector load into the multiply-adds that read it as their memory
// operand, and where one vector feeds several multiply-adds (a key vector for
// several query rows) it loads it again for each: twice the loads, which can
// bound a kernel that would otherwise be bound by its multiply-adds.
#pragma once

namespace attnx::simd {
// Internal linkage: this code is compiled once per instruction set.
namespace {

template <typename V>
inline void hold_in_register(V& v) {
#if defined(__GNUC__)
  // An empty statement that reads and writes v in a vector register ("v":
  // any of them, the upper 16 included where AVX-512 is on): v must be in
  // one here, and the load that produced it cannot move past this point.
  __asm__("" : "+v"(v));
#else
  (void)v;
#endif
}

}  // namespace
}  // namespace attnx::simd
