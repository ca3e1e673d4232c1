// Kernel dispatch: find what the CPU supports once, honour ATTNX_ISA, and
// hand the drivers the table of the chosen instruction set. The choice is
// made by the core itself, on first use, so that every user of it (the
// Python package, its extension module loaded alone, a C++ program) runs the
// same kernel.
#include <cctype>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "attnx/runtime.h"
#include "kernels/bf16_table.h"
#include "kernels/int8_table.h"
#include "kernels/kernel_table.h"

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#define ATTNX_X86_CPUID 1
#endif

namespace attnx {
namespace {

// The highest instruction set with kernels compiled into this build: the
// x86 kernels are built wherever the compiler targets x86-64, those of
// AVX512_BF16 where it has the flag too.
#if defined(ATTNX_HAVE_AVX512BF16_KERNELS)
constexpr Isa kBestCompiledIsa = Isa::kAvx512Bf16;
#elif defined(ATTNX_HAVE_X86_KERNELS)
constexpr Isa kBestCompiledIsa = Isa::kAvx512;
#else
constexpr Isa kBestCompiledIsa = Isa::kScalar;
#endif

Isa parse_isa(const std::string& name) {
  if (name == "scalar") return Isa::kScalar;
  if (name == "avx2") return Isa::kAvx2;
  if (name == "avx512") return Isa::kAvx512;
  if (name == "avx512_bf16") return Isa::kAvx512Bf16;
  throw std::invalid_argument("ATTNX_ISA='" + name +
                              "' is not a known kernel; use scalar, avx2, avx512 or avx512_bf16");
}

// ATTNX_ISA without surrounding white space, in lower case ("" where unset):
// " Scalar " asks for the scalar kernel.
std::string requested_isa() {
  const char* value = std::getenv("ATTNX_ISA");
  std::string name = value != nullptr ? value : "";
  const auto space = [](char c) { return std::isspace(static_cast<unsigned char>(c)) != 0; };
  size_t begin = 0, end = name.size();
  while (begin < end && space(name[begin])) ++begin;
  while (end > begin && space(name[end - 1])) --end;
  name = name.substr(begin, end - begin);
  for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return name;
}

}  // namespace

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx512Bf16: return "avx512_bf16";
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    default: return "scalar";
  }
}

Isa float_kernels_isa(Isa level) { return level == Isa::kAvx512Bf16 ? Isa::kAvx512 : level; }

#if defined(ATTNX_X86_CPUID)
namespace {
// F16C (vcvtph2ps), which the AVX2 kernels use to widen float16: CPUID leaf
// 1, ECX bit 29. Read directly: not every compiler's __builtin_cpu_supports
// knows "f16c". Its registers are the AVX ones, whose saving by the OS the
// avx2 check below has already confirmed.
bool cpu_has_f16c() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & (1u << 29)) != 0;
}
// AVX512_BF16 (vdpbf16ps, vcvtne[2]ps2bf16): CPUID leaf 7, subleaf 1, EAX
// bit 5; its registers are AVX-512's, checked with the AVX-512 level.
bool cpu_has_avx512_bf16() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx) && (eax & (1u << 5)) != 0;
}
}  // namespace
#endif

bool cpu_has_avx512_vnni() {
#if defined(ATTNX_X86_CPUID)
  // AVX512_VNNI (vpdpbusd): CPUID leaf 7, subleaf 0, ECX bit 11; its
  // registers are AVX-512's, which the AVX-512 level has checked.
  static const bool has = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    return detect_cpu_isa() >= Isa::kAvx512 && __get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) &&
           (ecx & (1u << 11)) != 0;
  }();
  return has;
#else
  return false;
#endif
}

Isa detect_cpu_isa() {
#if defined(ATTNX_X86_CPUID)
  // __builtin_cpu_supports also checks that the OS saves the wide registers.
  // The levels nest: ATTNX_ISA may pick any level up to the CPU's, so the
  // AVX-512 level also needs everything the AVX2 kernels use.
  __builtin_cpu_init();
  const bool avx2 =
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && cpu_has_f16c();
  if (!avx2) return Isa::kScalar;
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    return cpu_has_avx512_bf16() ? Isa::kAvx512Bf16 : Isa::kAvx512;
  return Isa::kAvx2;
#else
  return Isa::kScalar;
#endif
}

namespace {

// The kernel that an ATTNX_ISA value selects ("" = the best that both the CPU
// and this build have).
Isa choose_isa(const std::string& requested) {
  const Isa cpu = detect_cpu_isa();
  Isa wanted = cpu;
  if (!requested.empty()) {
    wanted = parse_isa(requested);
    if (wanted > cpu)
      throw std::invalid_argument("ATTNX_ISA='" + requested + "' but this CPU supports at most '" +
                                  isa_name(cpu) + "'");
    // Running a lower kernel than the one asked for would hide what a user
    // forcing a kernel wants to measure or test.
    if (wanted > kBestCompiledIsa)
      throw std::invalid_argument("ATTNX_ISA='" + requested +
                                  "' but this build has no kernel for it (its best is '" +
                                  isa_name(kBestCompiledIsa) +
                                  "': built for another CPU, with ATTNX_X86_KERNELS=OFF, or "
                                  "avx512_bf16 by a compiler without -mavx512bf16)");
  }
  return wanted < kBestCompiledIsa ? wanted : kBestCompiledIsa;
}

}  // namespace

Isa best_compiled_isa() { return kBestCompiledIsa; }

Isa active_isa() {
  // Chosen on the first call, by one thread while any others wait (the
  // initialisation of a function-local static). An initialisation that throws
  // leaves it unset, so that a bad ATTNX_ISA throws at every call rather than
  // letting some other kernel run.
  static const Isa chosen = choose_isa(requested_isa());
  return chosen;
}

const KernelTable<float>& active_kernels(float) {
  switch (float_kernels_isa(active_isa())) {
#if defined(ATTNX_HAVE_X86_KERNELS)
    case Isa::kAvx512: return avx512_kernels_f32();
    case Isa::kAvx2: return avx2_kernels_f32();
#endif
    default: return scalar_kernels_f32();
  }
}

const KernelTable<double>& active_kernels(double) {
  switch (float_kernels_isa(active_isa())) {
#if defined(ATTNX_HAVE_X86_KERNELS)
    case Isa::kAvx512: return avx512_kernels_f64();
    case Isa::kAvx2: return avx2_kernels_f64();
#endif
    default: return scalar_kernels_f64();
  }
}

const Bf16KernelTable* bf16_kernels_of(Isa level) {
  switch (level) {
#if defined(ATTNX_HAVE_AVX512BF16_KERNELS)
    case Isa::kAvx512Bf16: return &avx512_native_bf16_kernels();
#endif
#if defined(ATTNX_HAVE_X86_KERNELS)
    case Isa::kAvx512: return &avx512_bf16_kernels();
    case Isa::kAvx2: return &avx2_bf16_kernels();
#endif
    case Isa::kScalar: return &scalar_bf16_kernels();
    default: return nullptr;
  }
}

// The active level always has its table: choose_isa picks none above the
// build's best.
const Bf16KernelTable& active_bf16_kernels() { return *bf16_kernels_of(active_isa()); }

const Int8KernelTable* int8_kernels_of(Isa level) {
#if defined(ATTNX_HAVE_AVX512BF16_KERNELS)
  if (level >= Isa::kAvx512 && cpu_has_avx512_vnni()) return &avx512_vnni_int8_kernels();
#endif
#if defined(ATTNX_HAVE_X86_KERNELS)
  if (level >= Isa::kAvx2) return &avx2_int8_kernels();
#endif
  return level == Isa::kScalar ? &scalar_int8_kernels() : nullptr;
}

const Int8KernelTable& active_int8_kernels() { return *int8_kernels_of(active_isa()); }

}  // namespace attnx
