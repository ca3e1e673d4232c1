// How the products of precision "bfloat16" run on this CPU (see
// Bf16Products in kernels/bf16_table.h): vdpbf16ps's rate against the float
// kernels' multiply-adds, each measured in registers, or ATTNX_BF16_PRODUCTS.
#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "kernels/bf16_table.h"
#include "kernels/kernel_table.h"

namespace attnx {
namespace {

// Steps per timing of a probe: enough to outlast the clock's resolution,
// few enough to cost the first bfloat16 call little; the best of a few
// timings, taken in turns, so that a moment's interruption of one does not
// decide.
constexpr int64_t kProbeSteps = 1 << 13;
constexpr int kProbeTimings = 5;

template <typename Probe>
double seconds_of(Probe probe) {
  using Clock = std::chrono::steady_clock;
  const Clock::time_point start = Clock::now();
  volatile float keep = probe(kProbeSteps);
  (void)keep;
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Whether the native table's pairs make kPairsPayRatio times the products
// per second of the float multiply-adds: a pair step makes two products a
// lane, an FMA step one.
bool pairs_pay(const Bf16KernelTable& kt16, const KernelTable<float>& kt) {
  if (!kt16.native || kt16.dot_probe == nullptr) return false;
  double dot = 1e30, fma = 1e30;
  for (int i = 0; i < kProbeTimings; ++i) {
    dot = std::min(dot, seconds_of(kt16.dot_probe));
    fma = std::min(fma, seconds_of(kt.fma_probe));
  }
  return 2.0 * fma >= kPairsPayRatio * dot;
}

Bf16Products choose() {
  const char* value = std::getenv("ATTNX_BF16_PRODUCTS");
  std::string name = value != nullptr ? value : "";
  const auto space = [](char c) { return std::isspace(static_cast<unsigned char>(c)) != 0; };
  name.erase(std::remove_if(name.begin(), name.end(), space), name.end());
  for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (name == "pairs") return Bf16Products::kPairs;
  if (name == "float") return Bf16Products::kFloat;
  if (!name.empty())
    throw std::invalid_argument("ATTNX_BF16_PRODUCTS='" + std::string(value) +
                                "' is not known; use pairs or float (or leave it unset)");
  return pairs_pay(active_bf16_kernels(), active_kernels(float())) ? Bf16Products::kPairs
                                                                   : Bf16Products::kFloat;
}

}  // namespace

Bf16Products bf16_products() {
  // Decided on the first call (a throwing initialisation is tried again).
  static const Bf16Products chosen = choose();
  return chosen;
}

}  // namespace attnx
