// Transport: how one flat bucket is summed across ranks.
//
// The reducer (bucketing, ready tracking, copies) is written against this
// interface only; transports differ in how a bucket moves, nothing else.
// ProcessGroupTransport works with any c10d backend (gloo on CPU); the NCCL
// transport calls NCCL directly on the reducer's own streams.
#pragma once

#include <ATen/ATen.h>

#include <chrono>
#include <memory>
#include <string>

namespace fused_reducer {

// A collective in flight.
class PendingCollective {
 public:
  virtual ~PendingCollective() = default;
  // Blocks until the result may be read on the caller's stream. Throws on
  // failure or after `timeout`; the caller adds which bucket it was.
  virtual void wait(std::chrono::milliseconds timeout) = 0;
  // True when wait() would return at once (polled during backward to unpack
  // early); transports that cannot tell say false.
  virtual bool completed() { return false; }
};

class Transport {
 public:
  virtual ~Transport() = default;
  // Starts an in-place sum all-reduce of `flat` (a contiguous buffer owned by
  // the reducer, kept alive by it until wait() returns).
  virtual std::unique_ptr<PendingCollective> allreduce_sum(at::Tensor& flat) = 0;
  // The same, with a name for the collective, e.g. "bucket 3 of 7 (12 parameters, 4 MiB,
  // first 'fc.weight')", for errors a transport raises later and elsewhere than in this
  // collective's wait() (the NCCL watchdog's, raised by whichever call comes next, so the caller
  // cannot add the name itself). Transports that fail only inside wait() ignore it.
  virtual std::unique_ptr<PendingCollective> allreduce_sum_labeled(at::Tensor& flat,
                                                                   const std::string& label) {
    (void)label;
    return allreduce_sum(flat);
  }
  // Sharded mode (ShardedOptimizer): `flat` has a multiple of world_size elements and rank r
  // owns the r-th of world_size equal shards of it. Starts an in-place sum reduce-scatter: when
  // wait() returns, this rank's shard of `flat` holds the sum of every rank's shard r (the other
  // shards are unspecified). The sum is the same, element for element, as allreduce_sum's.
  virtual std::unique_ptr<PendingCollective> reduce_scatter_sum(at::Tensor& flat,
                                                                const std::string& label) {
    (void)flat;
    (void)label;
    TORCH_CHECK(false, "FusedReducer: the ", name(), " transport has no reduce-scatter");
  }
  // Starts an in-place all-gather: when wait() returns, every shard of `flat` holds its owner's
  // shard (each rank contributes its own shard of `flat`).
  virtual std::unique_ptr<PendingCollective> all_gather(at::Tensor& flat, const std::string& label) {
    (void)flat;
    (void)label;
    TORCH_CHECK(false, "FusedReducer: the ", name(), " transport has no all-gather");
  }
  // Short name for stats and error messages, e.g. "process_group(gloo)".
  virtual std::string name() const = 0;
  // Raises the error of a collective that failed in the background (the NCCL
  // watchdog), if any.
  virtual void check() {}
  // Releases the communicator: in-flight work gets until `deadline`, then it
  // is aborted. Idempotent; nothing may be launched afterwards.
  virtual void close(std::chrono::milliseconds deadline) { (void)deadline; }
};

}  // namespace fused_reducer
