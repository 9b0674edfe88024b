// NCCL transport: the torch-aware adapter of cuda/nccl_comm.h to the reducer's
// Transport interface. Compiled only in CUDA builds (setup.py defines
// FUSED_REDUCER_WITH_CUDA); the whole header is NCCL-only.
#pragma once
#ifdef FUSED_REDUCER_WITH_CUDA

#include <c10/cuda/CUDAStream.h>
#include <sys/types.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include "nccl_comm.h"
#include "transport.h"

namespace fused_reducer {

// Note [NCCL without host stalls]
// One in-place ncclAllReduce per bucket on the reducer's own high-priority
// stream. The host never waits for the GPU: the all-reduce's stream waits for
// the bucket copy (an event on the stream that packed it), and wait() only
// makes the caller's current stream wait for the all-reduce's completion
// event, so the unpack and everything the user queues next (optimizer, next
// forward) are ordered after it on the GPU while the CPU runs ahead, as with
// DDP. Timeouts and NCCL's asynchronous errors are the watchdog's job
// (cuda::Watchdog): at a deadline it aborts the communicator, and the next
// call into the transport (next bucket, wait, check(), close()) raises. That
// error names the collective that failed, which need not be the one being
// waited on: the reducer passes each bucket's name (allreduce_sum_labeled), so
// it reads "all-reduce of bucket 3 of 7 (..., first 'fc.weight') ... did not
// complete within its timeout"; an unnamed collective is "all-reduce #N". The
// watchdog aborts under the communicator's lock and is stopped (its thread
// joined) before the communicator is closed, even while a pending collective
// still holds it: see Note [Who may touch the communicator] in nccl_comm.h.
// Memory: each flat buffer is marked as used by the NCCL stream
// (record_stream), so a buffer freed by a rebuild is not reused before the
// all-reduce that reads it is done.
//
// Two communicators: the reducer also issues collectives through the torch
// process group (layout and buffer broadcasts). Those are enqueued by the
// host only after finalize_backward made the current stream wait for every
// bucket, and the process group's wait() makes the current stream wait for
// them before the next bucket's copy, so the two never overlap on the GPU.
// Nothing else may run collectives on another NCCL communicator of this
// device while backward runs: NCCL documents that concurrent collectives on
// two communicators of the same devices can deadlock. DDP does not have this
// rule, because it uses one communicator (the process group's) for buckets,
// SyncBatchNorm and comm hooks alike. So the NCCL transport is never combined
// with those (Note [One NCCL communicator] in python/fused_reducer/core/wrapper.py):
// backend="auto" picks the process group for a model with an NCCL
// SyncBatchNorm, and an explicit backend="nccl" with one, or a comm hook
// registered while this transport is in use, raises naming
// backend="process_group".
// Note [NCCL reduce-scatter and all-gather]
// The sharded mode's collectives go the all-reduce's way (the note above): the same stream, the
// same events before and after, record_stream, the watchdog with the bucket's name, the same
// communicator locks. Both are in place on the flat bucket of world_size equal shards of S
// elements, as NCCL documents in-place operation: ncclReduceScatter(send = flat, recv = flat +
// rank * S) and ncclAllGather(send = flat + rank * S, recv = flat).
class NcclTransport : public Transport {
 public:
  // Joins the communicator `unique_id` as `rank` of `world_size` on CUDA
  // `device`. Raises, after aborting, if the peers do not all join within
  // `timeout`, which also bounds every all-reduce.
  NcclTransport(const std::string& unique_id, int rank, int world_size, int device,
                std::chrono::milliseconds timeout);
  ~NcclTransport() override;

  std::unique_ptr<PendingCollective> allreduce_sum(at::Tensor& flat) override;
  // `label` names the bucket in the watchdog's error (see Note [NCCL without host stalls]).
  std::unique_ptr<PendingCollective> allreduce_sum_labeled(at::Tensor& flat,
                                                           const std::string& label) override;
  // Sharded mode, in place (Note [NCCL reduce-scatter and all-gather]).
  std::unique_ptr<PendingCollective> reduce_scatter_sum(at::Tensor& flat,
                                                        const std::string& label) override;
  std::unique_ptr<PendingCollective> all_gather(at::Tensor& flat,
                                                const std::string& label) override;
  std::string name() const override;
  void check() override;
  void close(std::chrono::milliseconds deadline) override;

 private:
  std::unique_ptr<PendingCollective> allreduce(at::Tensor& flat, ncclRedOp_t op,
                                               const std::string& label);
  // Raises unless `flat` splits into world-size equal shards, naming the sizes.
  void check_shardable(const at::Tensor& flat, const char* what) const;
  // One collective on `flat` (named `kind`, e.g. "all-reduce", and `label`), enqueued on the
  // transport's stream by `enqueue`: see Note [NCCL without host stalls].
  std::unique_ptr<PendingCollective> launch(at::Tensor& flat, const char* kind,
                                            const std::string& label,
                                            const std::function<void(cudaStream_t)>& enqueue);

  std::shared_ptr<cuda::NcclComm> comm_;
  std::shared_ptr<cuda::Watchdog> watchdog_;
  pid_t owner_pid_;  // a forked child abandons both above: see Note [Process life]
  int device_;
  std::chrono::milliseconds timeout_;
  c10::cuda::CUDAStream stream_;
  int64_t launched_ = 0;
};

std::string nccl_unique_id();
int nccl_version();

}  // namespace fused_reducer

#endif  // FUSED_REDUCER_WITH_CUDA
