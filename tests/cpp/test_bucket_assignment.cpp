// C++ unit tests of the bucket assignment rule (Note [Bucket assignment]).
// Hand-computed expectations; the property-based tests are in tests/test_bucket_assignment.py.
#include <cstdlib>
#include <iostream>
#include <stdexcept>

#include "bucket_assignment.h"

using fused_reducer::assign_buckets;
using Buckets = std::vector<std::vector<int64_t>>;

static int failures = 0;

static void expect(bool ok, const char* what) {
  if (!ok) {
    std::cerr << "FAILED: " << what << "\n";
    ++failures;
  }
}

int main() {
  // Four 4-byte tensors, reverse order, first bucket 4 bytes, cap 8: [3] [2 1] [0].
  expect(assign_buckets({{4, 0}, {4, 0}, {4, 0}, {4, 0}}, {3, 2, 1, 0}, {{4, 8}}) ==
             Buckets{{3}, {2, 1}, {0}},
         "first bucket closes at its limit, later ones at the cap");
  // A tensor larger than the cap gets a bucket of its own; it is never split.
  expect(assign_buckets({{100, 0}, {1, 0}}, {0, 1}, {{10, 10}}) == Buckets{{0}, {1}},
         "an oversized tensor is not split");
  // Groups never share a bucket; launch order follows the first element's position.
  expect(assign_buckets({{4, 0}, {4, 1}, {4, 0}, {4, 1}}, {0, 1, 2, 3}, {{100, 100}}) ==
             Buckets{{0, 2}, {1, 3}},
         "dtype/device groups are bucketed separately");
  // Each group has its own first bucket.
  expect(assign_buckets({{4, 0}, {4, 1}, {4, 0}, {4, 1}}, {0, 1, 2, 3}, {{4, 100}}) ==
             Buckets{{0}, {1}, {2}, {3}},
         "every group starts with a first-size bucket");
  // Everything fits one bucket when the first bucket is large.
  expect(assign_buckets({{4, 0}, {4, 0}, {4, 0}}, {2, 1, 0}, {{1 << 20, 8}}) == Buckets{{2, 1, 0}},
         "a large first bucket takes everything");

  // A small last bucket: the shortest tail reaching last_bytes is split off
  // first, then [first, cap] applies to the rest. Sizes 4 each, order 0..5.
  expect(assign_buckets({{4, 0}, {4, 0}, {4, 0}, {4, 0}, {4, 0}, {4, 0}}, {0, 1, 2, 3, 4, 5},
                        {{8, 8}, 5}) == Buckets{{0, 1}, {2, 3}, {4, 5}},
         "the last bucket is the shortest tail reaching last_bytes (may exceed it)");
  expect(assign_buckets({{4, 0}, {4, 0}, {4, 0}, {4, 0}}, {3, 2, 1, 0}, {{1 << 20, 8}, 4}) ==
             Buckets{{3, 2, 1}, {0}},
         "a large first bucket takes everything but the last bucket");
  expect(assign_buckets({{4, 0}, {4, 0}}, {0, 1}, {{4, 4}, 100}) == Buckets{{0}, {1}},
         "no last bucket when it would hold the whole group");
  expect(assign_buckets({{4, 0}, {4, 1}, {4, 0}, {4, 1}}, {0, 1, 2, 3}, {{100, 100}, 4}) ==
             Buckets{{0}, {1}, {2}, {3}},
         "every group gets its own last bucket");

  // A list of limits (DDP's bucket_cap_mb_list): the k-th bucket of a group has
  // the k-th limit, the last one repeats. Sizes 4 each, order 0..6.
  expect(assign_buckets({{4, 0}, {4, 0}, {4, 0}, {4, 0}, {4, 0}, {4, 0}, {4, 0}},
                        {0, 1, 2, 3, 4, 5, 6}, {{4, 12, 8}}) ==
             Buckets{{0}, {1, 2, 3}, {4, 5}, {6}},
         "the k-th bucket closes at the k-th limit, the last limit repeats");
  expect(assign_buckets({{4, 0}, {4, 0}, {4, 0}}, {2, 1, 0}, {{8}}) == Buckets{{2, 1}, {0}},
         "a one-entry list is the limit of every bucket");
  expect(assign_buckets({{4, 0}, {4, 1}, {4, 0}, {4, 1}, {4, 0}}, {0, 1, 2, 3, 4}, {{4, 100}}) ==
             Buckets{{0}, {1}, {2, 4}, {3}},
         "each group walks the list from its start");

  bool threw = false;
  try {
    assign_buckets({{4, 0}}, {0}, {{8, 8}, -1});
  } catch (const std::invalid_argument& e) {
    threw = std::string(e.what()).find("last_bucket_bytes") != std::string::npos;
  }
  expect(threw, "a negative last bucket is refused, naming last_bucket_bytes");

  threw = false;
  try {
    assign_buckets({{4, 0}}, {0}, {{0, 8}});
  } catch (const std::invalid_argument& e) {
    threw = std::string(e.what()).find("bucket_caps_bytes[0]") != std::string::npos;
  }
  expect(threw, "a zero first bucket is refused, naming bucket_caps_bytes[0]");
  threw = false;
  try {
    assign_buckets({{4, 0}}, {0}, {{}});
  } catch (const std::invalid_argument& e) {
    threw = std::string(e.what()).find("bucket_caps_bytes") != std::string::npos;
  }
  expect(threw, "an empty list of limits is refused");
  threw = false;
  try {
    assign_buckets({{4, 0}, {4, 0}}, {0, 0}, {{8, 8}});
  } catch (const std::invalid_argument&) {
    threw = true;
  }
  expect(threw, "an order that is not a permutation is refused");

  if (failures == 0) std::cout << "bucket assignment: all checks passed\n";
  return failures == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
