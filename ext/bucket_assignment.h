// Bucket assignment: which parameters share a flat gradient buffer.
//
// Torch-free on purpose: it is the one implementation of the rule, unit-tested
// from C++ (ctest) and from Python (hypothesis, against an independent reference).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace fused_reducer {

// What bucketing needs to know about one parameter.
struct TensorInfo {
  int64_t bytes;  // numel * element size
  int64_t group;  // parameters only share a bucket within a group: one group per (dtype, device)
};

// Size limits of the buckets of one group, in launch order: caps[0], caps[1],
// ..., then the last entry of caps for every later bucket (DDP's
// bucket_cap_mb_list rule). [first, cap] is the common case.
struct BucketLimits {
  std::vector<int64_t> caps;
  int64_t last_bytes = 0;  // 0: no separate last bucket
};

// Note [Bucket assignment]
// Parameters are visited in `order` (the order their gradients are expected to
// become ready: reverse registration order before the first rebuild, observed
// ready order after). Each group fills one open bucket at a time; a bucket
// closes as soon as its byte size reaches its limit, so a parameter is never
// split and a bucket may exceed its limit by less than one parameter. The k-th
// bucket of a group has limit caps[min(k, caps.size() - 1)].
// Buckets are returned in launch order: by the position in `order` of their
// first parameter. Each bucket lists parameter indices in `order` order.
//
// A small last bucket (last_bytes > 0): before the rule above runs, each
// group's tail is split off into a bucket of its own: the shortest suffix of
// the group's parameters (in `order`) whose byte size reaches last_bytes. Like
// every bucket it may exceed its limit by less than one parameter (its first).
// If that suffix would be the whole group, nothing is split off. The rest of
// the group is then bucketed by caps as above, and the tail
// launches after it. A small last bucket shortens the reduction that cannot
// overlap backward: the one launched when the last gradients are ready.
std::vector<std::vector<int64_t>> assign_buckets(
    const std::vector<TensorInfo>& tensors,
    const std::vector<int64_t>& order,
    const BucketLimits& limits);

// Throws std::invalid_argument naming `setting` unless 0 < bytes.
void check_bucket_bytes(const std::string& setting, int64_t bytes);

// Throws std::invalid_argument unless caps is non-empty and every entry > 0.
void check_bucket_caps(const std::vector<int64_t>& caps);

// Throws std::invalid_argument naming last_bucket_bytes unless 0 <= bytes (0 = off).
void check_last_bucket_bytes(int64_t bytes);

}  // namespace fused_reducer
