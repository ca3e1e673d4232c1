// The rules every attention path follows for non-finite scores live with
// the other masking rules: attention/masking/non_finite.h.
#pragma once

#include "attention/masking/non_finite.h"
