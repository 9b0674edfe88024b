// A thin, torch-free wrapper of one rank's NCCL communicator, and the
// watchdog that bounds every collective in flight on it.
//
// Torch-free on purpose (CUDA runtime + NCCL only), like the copy kernel: the
// torch-aware adapter (streams, tensors, the reducer's Transport interface)
// is ext/nccl_transport.h. See Note [NCCL without host stalls] there.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

namespace fused_reducer::cuda {

// 128 bytes (NCCL_UNIQUE_ID_BYTES) made on one rank and shared with the others.
std::string nccl_unique_id();
int nccl_version();

// One rank of a non-blocking NCCL communicator on one CUDA device.
class NcclComm {
 public:
  // Joins `unique_id` as `rank` of `world_size` on `device`. On any error, a
  // peer that never joins within `timeout` included, the communicator is
  // aborted (never leaked) and std::runtime_error says what happened.
  NcclComm(const std::string& unique_id, int rank, int world_size, int device,
           std::chrono::milliseconds timeout);
  ~NcclComm();  // close() with a short deadline if the owner did not
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  // In-place all-reduce of `count` elements at `data`, enqueued on `stream`.
  void allreduce(void* data, size_t count, ncclDataType_t type, ncclRedOp_t op,
                 cudaStream_t stream, std::chrono::milliseconds timeout);
  // ncclSuccess, ncclInProgress, or the communicator's asynchronous error.
  ncclResult_t async_error() const;
  std::string last_error() const;
  // Stops everything in flight without waiting for peers. Idempotent.
  void abort();
  bool aborted() const { return aborted_.load(); }
  // Finalize (flushes what is in flight), polled up to `deadline`, then
  // destroy; at the deadline, or on an error, abort. Idempotent. Returns true
  // when the communicator was finalized cleanly.
  bool close(std::chrono::milliseconds deadline);

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  int device() const { return device_; }

 private:
  // Polls the non-blocking communicator until `what` is done; aborts and
  // throws on error or after `timeout`.
  void wait_until_done(const char* what, std::chrono::milliseconds timeout);

  ncclComm_t comm_ = nullptr;
  int rank_;
  int world_size_;
  int device_;
  std::atomic<bool> aborted_{false};
  std::atomic<bool> closed_{false};
  mutable std::mutex mutex_;  // NCCL calls on one communicator are not thread-safe
};

// Watches collectives by their completion events on a thread of its own: when
// one is not done by its deadline, or NCCL reports an asynchronous error, it
// aborts the communicator and keeps the error, which check() then throws on
// the owner's next call. Nobody else waits on the host.
class Watchdog {
 public:
  explicit Watchdog(std::shared_ptr<NcclComm> comm);
  ~Watchdog();  // stops the thread
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  // `done` must stay valid until it completes or the watchdog stops (the
  // watchdog holds a reference).
  void watch(std::shared_ptr<cudaEvent_t> done, std::chrono::milliseconds timeout,
             std::string what);
  // Throws std::runtime_error with the first failure seen, if any.
  void check() const;
  // Blocks until every watched collective completed or failed (close()).
  void drain(std::chrono::milliseconds deadline);

 private:
  struct Entry {
    std::shared_ptr<cudaEvent_t> done;
    std::chrono::steady_clock::time_point deadline;
    std::string what;
  };
  void run();
  void fail(const std::string& why);

  std::shared_ptr<NcclComm> comm_;
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<Entry> in_flight_;
  std::string error_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace fused_reducer::cuda
