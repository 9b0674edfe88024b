// NCCL transport: one in-place ncclAllReduce per bucket on the reducer's own
// high-priority stream, ordered against the compute stream by CUDA events.
// Compiled only in CUDA builds (setup.py defines FUSED_REDUCER_WITH_CUDA).
#pragma once

#include <c10/cuda/CUDAStream.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <string>

#include "transport.h"

namespace fused_reducer {

// 128 bytes (NCCL_UNIQUE_ID_BYTES) made on one rank and shared with the others.
std::string nccl_unique_id();
int nccl_version();

class NcclTransport : public Transport, public std::enable_shared_from_this<NcclTransport> {
 public:
  // Joins the communicator `unique_id` as `rank` of `world_size` on CUDA
  // `device`. Raises, after aborting, if the peers do not all join within `timeout`.
  NcclTransport(const std::string& unique_id, int rank, int world_size, int device,
                std::chrono::milliseconds timeout);
  ~NcclTransport() override;

  std::unique_ptr<PendingCollective> allreduce_sum(at::Tensor& flat) override;
  std::unique_ptr<PendingCollective> allreduce_average(at::Tensor& flat) override;
  bool averages() const override;  // ncclAvg: NCCL >= 2.10
  std::string name() const override;

  // Blocks until `done` has happened on the device, polling the communicator
  // for asynchronous errors; aborts it and throws after `timeout`.
  void wait_event(cudaEvent_t done, std::chrono::milliseconds timeout);

 private:
  std::unique_ptr<PendingCollective> allreduce(at::Tensor& flat, ncclRedOp_t op);
  void wait_until_enqueued(const char* what, std::chrono::milliseconds timeout);
  [[noreturn]] void abort_and_throw(const std::string& why);

  ncclComm_t comm_ = nullptr;
  int rank_;
  int world_size_;
  int device_;
  std::chrono::milliseconds timeout_;
  c10::cuda::CUDAStream stream_;
  std::atomic<bool> aborted_{false};
};

}  // namespace fused_reducer
