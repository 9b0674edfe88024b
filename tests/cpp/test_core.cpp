// C++ tests of the torch-side core that need no process group: the bucket copy
// (Note [Bucket copies]) against plain ATen arithmetic.
#include <ATen/ATen.h>

#include <cstdlib>
#include <iostream>

#include "bucket_copy.h"

int main() {
  int failures = 0;
  for (auto dtype : {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf}) {
    auto a = at::randn({7, 3}).to(dtype);
    auto b = at::randn({5}).to(dtype);
    auto flat = at::full({26}, 123.0, dtype);  // poisoned
    auto va = flat.narrow(0, 0, 21).view({7, 3});
    auto vb = flat.narrow(0, 21, 5);
    fused_reducer::scaled_copy({{a, va}, {b, vb}}, 0.5);
    if (!at::equal(va, a * 0.5) || !at::equal(vb, b * 0.5)) {
      std::cerr << "FAILED: scaled copy into a flat buffer, dtype " << dtype << "\n";
      ++failures;
    }
    fused_reducer::scaled_copy({{at::Tensor(), vb}}, 0.5);
    if (!at::equal(vb, at::zeros_like(vb))) {
      std::cerr << "FAILED: an undefined source writes zeros, dtype " << dtype << "\n";
      ++failures;
    }
  }
  if (failures == 0) std::cout << "core: all checks passed\n";
  return failures == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
