// Runtime configuration: which SIMD kernel runs and how many threads.
#pragma once

#include <string>

namespace attnx {

// The instruction sets a kernel can be built for, lowest first. kAvx512Bf16
// is AVX-512 with AVX512_BF16: the AVX-512 float kernels, and the bfloat16
// products on vdpbf16ps (at every lower level they are emulated).
enum class Isa { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3 };

const char* isa_name(Isa isa);

// The instruction set of the float32 and float64 kernels at a level: the
// level itself, but kAvx512 at kAvx512Bf16.
Isa float_kernels_isa(Isa level);

// The best instruction set this CPU (and OS) supports.
Isa detect_cpu_isa();

// The best instruction set this build has kernels for: every lower one is
// built too (the portable kernel always; AVX2 and AVX-512 together where the
// compiler targets x86-64, unless ATTNX_X86_KERNELS is OFF).
Isa best_compiled_isa();

// The kernel in use, chosen on the first call (thread-safe) from CPUID and
// the ATTNX_ISA variable: its name, in any case and with spaces around it,
// forces a kernel; unset or empty, the best that both the CPU and this build
// have runs. Throws std::invalid_argument, at every call, where ATTNX_ISA
// names no kernel, one the CPU lacks, or one this build has no kernel for.
Isa active_isa();

int get_num_threads();
void set_num_threads(int n);  // n >= 1
bool have_openmp();
std::string compiler_name();

// The float32 multiply-add rate (GFLOP/s) of the active kernel on `threads`
// threads, each running register-resident chains of vector multiply-adds
// for about `seconds`: the arithmetic peak benchmarks measure attnx against.
double measure_fma_peak(int threads, double seconds);

}  // namespace attnx
