#include "bucket_assignment.h"

#include <algorithm>
#include <map>
#include <stdexcept>

namespace fused_reducer {

void check_bucket_bytes(const std::string& setting, int64_t bytes) {
  if (bytes <= 0) {
    throw std::invalid_argument(
        setting + " must be a positive number of bytes, got " + std::to_string(bytes));
  }
}

std::vector<std::vector<int64_t>> assign_buckets(
    const std::vector<TensorInfo>& tensors,
    const std::vector<int64_t>& order,
    const BucketLimits& limits) {
  check_bucket_bytes("first_bucket_bytes", limits.first_bytes);
  check_bucket_bytes("bucket_cap_bytes", limits.cap_bytes);
  if (order.size() != tensors.size()) {
    throw std::invalid_argument(
        "assign_buckets: order has " + std::to_string(order.size()) + " entries for " +
        std::to_string(tensors.size()) + " parameters");
  }
  std::vector<bool> seen(tensors.size(), false);

  struct OpenBucket {
    std::vector<int64_t> indices;
    int64_t bytes = 0;
    int64_t closed_before = 0;  // buckets this group already closed: picks the limit
  };
  std::map<int64_t, OpenBucket> open;  // group -> bucket being filled
  std::vector<std::pair<size_t, std::vector<int64_t>>> closed;  // (position of first, indices)
  std::vector<size_t> position(tensors.size());

  for (size_t pos = 0; pos < order.size(); ++pos) {
    const int64_t index = order[pos];
    if (index < 0 || index >= static_cast<int64_t>(tensors.size()) || seen[index]) {
      throw std::invalid_argument(
          "assign_buckets: order is not a permutation (bad or repeated index " +
          std::to_string(index) + ")");
    }
    seen[index] = true;
    position[index] = pos;
    OpenBucket& bucket = open[tensors[index].group];
    bucket.indices.push_back(index);
    bucket.bytes += tensors[index].bytes;
    const int64_t limit = bucket.closed_before == 0 ? limits.first_bytes : limits.cap_bytes;
    if (bucket.bytes >= limit) {
      closed.emplace_back(position[bucket.indices.front()], std::move(bucket.indices));
      bucket.indices.clear();
      bucket.bytes = 0;
      bucket.closed_before += 1;
    }
  }
  for (auto& [group, bucket] : open) {
    if (!bucket.indices.empty()) {
      closed.emplace_back(position[bucket.indices.front()], std::move(bucket.indices));
    }
  }
  std::sort(closed.begin(), closed.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<std::vector<int64_t>> buckets;
  buckets.reserve(closed.size());
  for (auto& entry : closed) {
    buckets.push_back(std::move(entry.second));
  }
  return buckets;
}

}  // namespace fused_reducer
