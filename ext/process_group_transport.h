// Transport over a c10d ProcessGroup: any backend, called from C++ on whole buckets.
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "transport.h"

namespace fused_reducer {

// Note [Process-group work without host stalls]
// On ProcessGroupNCCL, Work::wait(timeout) with a timeout blocks the host until the collective
// has finished on the GPU; without one (kNoTimeout) it only makes the current stream wait, like
// NcclTransport's wait (Note [NCCL without host stalls]). So work that is stream-ordered (CUDA
// tensors on NCCL) is waited without a timeout, and the reducer's own deadline is kept without
// blocking: each such collective is remembered with its launch time and the timeout it was
// waited with (WorkDeadlines), and whichever call comes next into the transport (a wait,
// check(), the next all-reduce) raises for one that is still not isCompleted() past its
// deadline. Any other work (gloo, on CPU or CUDA tensors: its wait blocks the host anyway)
// keeps wait(timeout). The process group's own timeout and watchdog apply as before.

// Whether `backend`'s wait on tensors of `device` only orders the current stream after the
// collective (NCCL on CUDA), rather than blocking the host until it is done.
bool stream_ordered_wait(c10::DeviceType device, const std::string& backend);

// Stream-ordered collectives that were waited on (so the host went on) but may still run on
// the device, each with its deadline. Shared by a transport and its pending collectives.
class WorkDeadlines {
 public:
  using Clock = std::chrono::steady_clock;
  // Keeps `work` until it completes; `what` names it in the error, e.g. "all-reduce of bucket 3
  // of 7 (...) over process_group(nccl)". A timeout of kNoTimeout sets no deadline.
  void watch(c10::intrusive_ptr<c10d::Work> work, std::string what, Clock::time_point launched,
             std::chrono::milliseconds timeout);
  // Forgets completed work; raises the error of one that failed, or for one still running
  // past its deadline ("<what> did not complete within <timeout> ms ...").
  void check();

 private:
  struct Watched {
    c10::intrusive_ptr<c10d::Work> work;
    std::string what;
    Clock::time_point launched;
    std::chrono::milliseconds timeout;
  };
  std::mutex mutex_;  // the autograd hook thread launches, the main thread waits
  std::vector<Watched> watched_;
};

// One process-group collective in flight (see Note [Process-group work without host stalls]).
class PendingWork : public PendingCollective {
 public:
  PendingWork(c10::intrusive_ptr<c10d::Work> work, bool stream_ordered, std::string what,
              std::shared_ptr<WorkDeadlines> deadlines);
  bool completed() override { return work_->isCompleted(); }
  void wait(std::chrono::milliseconds timeout) override;

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  bool stream_ordered_;
  std::string what_;
  std::shared_ptr<WorkDeadlines> deadlines_;
  WorkDeadlines::Clock::time_point launched_ = WorkDeadlines::Clock::now();
};

// Note [Process-group reduce-scatter and all-gather]
// Sharded mode (Transport::reduce_scatter_sum / all_gather) in place on the flat bucket, rank r's
// shard being flat[r*S, (r+1)*S): reduce_scatter_single(out = that shard, in = flat) and
// all_gather_single(out = flat, in = that shard), the forms NCCL documents as in place (its
// recvbuff == sendbuff + rank * count) and the ones Megatron's distributed optimizer calls the
// same way. Gloo is the exception for the reduce-scatter: ProcessGroupGloo implements
// reduce_scatter_single as an all-reduce of a clone of the input whose shard is copied into the
// output inside a LambdaWork::wait() that ignores its timeout (it waits for the group's own,
// 30 minutes by default: checked on torch 2.14, a peer that never comes held wait(1 s) for the
// group's 8 s). So on gloo the bucket is all-reduced in place instead: the same sum, bit for bit
// (the clone's all-reduce is this all-reduce), the same bytes on the wire, no clone and no copy,
// and wait(timeout) keeps the reducer's timeout. Gloo's all_gather_single honours wait(timeout)
// and copies from a flat temporary of its own, so an input that aliases the output is safe.
// Both go through PendingWork and WorkDeadlines like the all-reduce.
class ProcessGroupTransport : public Transport {
 public:
  explicit ProcessGroupTransport(c10::intrusive_ptr<c10d::ProcessGroup> group);
  std::unique_ptr<PendingCollective> allreduce_sum(at::Tensor& flat) override;
  std::unique_ptr<PendingCollective> allreduce_sum_labeled(at::Tensor& flat,
                                                           const std::string& label) override;
  // See Note [Process-group reduce-scatter and all-gather].
  std::unique_ptr<PendingCollective> reduce_scatter_sum(at::Tensor& flat,
                                                        const std::string& label) override;
  std::unique_ptr<PendingCollective> all_gather(at::Tensor& flat,
                                                const std::string& label) override;
  std::string name() const override;
  void check() override;

 private:
  std::unique_ptr<PendingCollective> allreduce(at::Tensor& flat, const std::string& what);
  // The pending object of `work` on `flat`'s device, named `what` (+ " over <name>").
  std::unique_ptr<PendingCollective> pending(c10::intrusive_ptr<c10d::Work> work,
                                             const at::Tensor& flat, const std::string& what);
  // `flat` as a 1-D tensor of world-size equal shards; raises naming the rule otherwise.
  at::Tensor shardable(const at::Tensor& flat, const char* op) const;

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  std::shared_ptr<WorkDeadlines> deadlines_ = std::make_shared<WorkDeadlines>();
  int64_t launched_ = 0;
};

}  // namespace fused_reducer
