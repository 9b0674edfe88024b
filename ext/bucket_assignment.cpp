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

void check_bucket_caps(const std::vector<int64_t>& caps) {
  if (caps.empty()) {
    throw std::invalid_argument("bucket_caps_bytes must list at least one size limit, got []");
  }
  for (size_t k = 0; k < caps.size(); ++k) {
    check_bucket_bytes("bucket_caps_bytes[" + std::to_string(k) + "]", caps[k]);
  }
}

void check_last_bucket_bytes(int64_t bytes) {
  if (bytes < 0) {
    throw std::invalid_argument(
        "last_bucket_bytes must be 0 or None (off) or a positive number of bytes, got " +
        std::to_string(bytes));
  }
}

std::vector<std::vector<int64_t>> assign_buckets(
    const std::vector<TensorInfo>& tensors,
    const std::vector<int64_t>& order,
    const BucketLimits& limits) {
  check_bucket_caps(limits.caps);
  check_last_bucket_bytes(limits.last_bytes);
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
  }

  // The last bucket of each group: the shortest suffix reaching last_bytes,
  // unless that is the whole group. See Note [Bucket assignment].
  std::vector<bool> in_tail(tensors.size(), false);
  if (limits.last_bytes > 0) {
    std::map<int64_t, int64_t> tail_bytes;     // group -> bytes of its suffix so far
    std::map<int64_t, int64_t> group_size;     // group -> parameters
    std::map<int64_t, std::vector<int64_t>> tails;  // group -> suffix, last to first
    for (size_t pos = order.size(); pos-- > 0;) {
      const int64_t index = order[pos];
      const int64_t group = tensors[index].group;
      group_size[group] += 1;
      int64_t& bytes = tail_bytes[group];
      if (bytes >= limits.last_bytes) {
        continue;  // this group's tail is complete; `index` belongs to the rest
      }
      bytes += tensors[index].bytes;
      tails[group].push_back(index);
    }
    for (auto& [group, tail] : tails) {
      if (static_cast<int64_t>(tail.size()) == group_size[group]) {
        continue;  // the suffix is the whole group: no separate last bucket
      }
      for (int64_t index : tail) {
        in_tail[index] = true;
      }
      std::reverse(tail.begin(), tail.end());
      closed.emplace_back(position[tail.front()], tail);
    }
  }

  for (size_t pos = 0; pos < order.size(); ++pos) {
    const int64_t index = order[pos];
    if (in_tail[index]) {
      continue;
    }
    OpenBucket& bucket = open[tensors[index].group];
    bucket.indices.push_back(index);
    bucket.bytes += tensors[index].bytes;
    const int64_t limit = limits.caps[std::min<size_t>(
        static_cast<size_t>(bucket.closed_before), limits.caps.size() - 1)];
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
