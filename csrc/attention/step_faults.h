// A fault the tests inject into the next decoding step, to check that a step
// that fails after writing its keys and values leaves the cache as it was.
#pragma once

namespace attnx {

enum class StepStage { kNone = 0, kAttention = 1, kOutputProjection = 2 };

// The next mha_step to reach `stage` throws std::bad_alloc there (once).
void fail_next_step_at(StepStage stage);

}  // namespace attnx
