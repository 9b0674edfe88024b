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
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

namespace fused_reducer::cuda {

// 128 bytes (NCCL_UNIQUE_ID_BYTES) made on one rank and shared with the others.
std::string nccl_unique_id();
int nccl_version();

// Note [No NCCL collective under graph capture]
// A collective launched while its stream is being captured (torch.cuda.graph, torch.compile's
// "reduce-overhead" mode) would be recorded, not run, and its completion event polled by the
// watchdog (cudaEventQuery) and by completed(): a query on a capturing stream's event invalidates
// the capture, and the watchdog would then abort the communicator for a collective that never ran.
// So the transport refuses to launch or poll under capture, with this message (empty when
// `status` is cudaStreamCaptureStatusNone). The watchdog thread itself runs in relaxed capture
// mode, so that its queries of collectives launched before a capture began (on another stream)
// do not invalidate it.
std::string capture_refusal(cudaStreamCaptureStatus status, int device);

// The NCCL entry points NcclComm calls on its communicator: the real library
// by default; a test passes fakes (tests/cpp/test_cuda_core.cpp checks the lock
// discipline of Note [Who may touch the communicator] without a GPU).
struct NcclApi {
  ncclResult_t (*all_reduce)(const void* send, void* recv, size_t count, ncclDataType_t type,
                             ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream);
  ncclResult_t (*get_async_error)(ncclComm_t comm, ncclResult_t* state);
  ncclResult_t (*finalize)(ncclComm_t comm);
  ncclResult_t (*destroy)(ncclComm_t comm);
  ncclResult_t (*abort)(ncclComm_t comm);
  const char* (*last_error)(ncclComm_t comm);
  // Sharded mode (last, so that an initializer of the fields above still compiles; a null entry
  // is refused by the call that needs it).
  ncclResult_t (*reduce_scatter)(const void* send, void* recv, size_t recv_count,
                                 ncclDataType_t type, ncclRedOp_t op, ncclComm_t comm,
                                 cudaStream_t stream);
  ncclResult_t (*all_gather)(const void* send, void* recv, size_t send_count, ncclDataType_t type,
                             ncclComm_t comm, cudaStream_t stream);
};
const NcclApi& real_nccl_api();

// Bytes per element of `type`; throws std::runtime_error for a type it does not know.
size_t nccl_type_bytes(ncclDataType_t type);

// Note [Who may touch the communicator]
// Two threads use one communicator: the owner's (the autograd hook thread:
// all-reduce, reduce-scatter, all-gather, close) and the watchdog's
// (asynchronous-error polls, abort). No NCCL call on it ever overlaps another,
// and none follows its release:
// - `mutex_` is held for every single NCCL call on `comm_` and for its release
//   (ncclCommAbort / ncclCommDestroy). Polling loops (an enqueue or a finalize
//   in progress) hold it for one ncclCommGetAsyncError at a time and release it
//   while they sleep, so the watchdog can abort a stuck operation at its next
//   poll, and its own 1 ms polls never starve the owner.
// - `comm_` becomes nullptr, under `mutex_`, in the same critical section that
//   releases it, and `aborted_` is set first: a thread that takes `mutex_` next
//   sees the communicator gone instead of using freed memory, and aborted()
//   (lock-free) never reports a live communicator that is being destroyed.
// - `op_mutex_` serialises the owner's operations (a collective and its
//   enqueue poll, a finalize and its poll): NCCL forbids a new call on a
//   non-blocking communicator while one is in progress. abort() never takes
//   it, so it cannot be held off by a stuck operation.
// Lock order: op_mutex_, then mutex_; the watchdog takes only mutex_, and never
// while holding its own (Watchdog::run releases it first).

// One rank of a non-blocking NCCL communicator on one CUDA device.
class NcclComm {
 public:
  // Joins `unique_id` as `rank` of `world_size` on `device`. On any error, a
  // peer that never joins within `timeout` included, the communicator is
  // aborted (never leaked) and std::runtime_error says what happened.
  NcclComm(const std::string& unique_id, int rank, int world_size, int device,
           std::chrono::milliseconds timeout);
  // Adopts `comm`, an initialised communicator that `api` operates (tests).
  NcclComm(const NcclApi& api, ncclComm_t comm, int rank, int world_size, int device);
  ~NcclComm();  // close() with a short deadline if the owner did not
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  // In-place all-reduce of `count` elements at `data`, enqueued on `stream`.
  void allreduce(void* data, size_t count, ncclDataType_t type, ncclRedOp_t op,
                 cudaStream_t stream, std::chrono::milliseconds timeout);
  // In place on `data`, `world_size() * count` elements in world_size shards of `count`, rank
  // r owning the r-th (sharded mode). reduce_scatter: ncclReduceScatter(send = data, recv = the
  // shard of this rank), which NCCL documents as in place; after it this rank's shard holds the
  // sum of every rank's. all_gather: ncclAllGather(send = the shard of this rank, recv = data),
  // in place likewise. Same locks and enqueue poll as allreduce.
  void reduce_scatter(void* data, size_t count, ncclDataType_t type, ncclRedOp_t op,
                      cudaStream_t stream, std::chrono::milliseconds timeout);
  void all_gather(void* data, size_t count, ncclDataType_t type, cudaStream_t stream,
                  std::chrono::milliseconds timeout);
  // ncclSuccess, ncclInProgress, or the communicator's asynchronous error;
  // ncclInvalidUsage once it was released.
  ncclResult_t async_error() const;
  std::string last_error() const;
  // Stops everything in flight without waiting for peers, under the lock (see
  // Note [Who may touch the communicator]). Idempotent; any thread.
  void abort();
  // True once the communicator was released (aborted, or destroyed by close()):
  // no NCCL call is made on it any more.
  bool aborted() const { return aborted_.load(); }
  // Finalize (flushes what is in flight), polled up to `deadline`, then
  // destroy; at the deadline, or on an error, abort. Idempotent. Returns true
  // when the communicator was finalized cleanly.
  bool close(std::chrono::milliseconds deadline);

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  int device() const { return device_; }

 private:
  // Polls the non-blocking communicator until `what` is done, taking `mutex_`
  // per poll; aborts and throws on error or after `timeout`, throws if another
  // thread aborted it meanwhile.
  void wait_until_done(const std::string& what, std::chrono::milliseconds timeout);
  // One collective: `call` (named `call_name` in errors) on the communicator under both locks,
  // then its enqueue polled; `what` is e.g. "an all-reduce".
  void launch(const std::string& what, const char* call_name,
              const std::function<ncclResult_t(ncclComm_t)>& call,
              std::chrono::milliseconds timeout);
  // `data` + this rank's shard of `count` elements of `type`.
  void* own_shard(void* data, size_t count, ncclDataType_t type) const;
  // With mutex_ held.
  void abort_locked();
  std::string gone_locked(const std::string& what) const;

  const NcclApi* api_;
  ncclComm_t comm_ = nullptr;  // guarded by mutex_; nullptr once released
  int rank_;
  int world_size_;
  int device_;
  std::atomic<bool> aborted_{false};  // set before comm_ is released
  std::atomic<bool> closed_{false};
  std::mutex op_mutex_;
  mutable std::mutex mutex_;
};

// Watches collectives by their completion events on a thread of its own: when
// one is not done by its deadline, or NCCL reports an asynchronous error, it
// records the error, then aborts the communicator (under the communicator's
// lock, never its own), and check() throws that error on the owner's next call.
// Nobody else waits on the host. stop() ends and joins the thread; the owner
// calls it before closing the communicator, since pending collectives may keep
// the watchdog itself alive longer (they call check()).
class Watchdog {
 public:
  // How a completion event is polled: cudaEventQuery, or a test's fake.
  using EventQuery = std::function<cudaError_t(cudaEvent_t)>;
  // How the thread selects the communicator's device: cudaSetDevice, or a test's fake. If that
  // fails, the watchdog cannot poll or abort on the right device: it records the error and
  // aborts the communicator at once (never a watchdog that silently watches nothing).
  using SelectDevice = std::function<cudaError_t(int)>;
  explicit Watchdog(std::shared_ptr<NcclComm> comm, EventQuery query = cudaEventQuery,
                    SelectDevice select_device = cudaSetDevice);
  ~Watchdog();  // stop()
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  // `done` must stay valid until it completes or the watchdog stops (the
  // watchdog holds a reference). `what` names the collective in the error,
  // e.g. "all-reduce of bucket 3 of 7 (...)". Ignored after stop().
  void watch(std::shared_ptr<cudaEvent_t> done, std::chrono::milliseconds timeout,
             std::string what);
  // Throws std::runtime_error with the first failure seen, if any (also after stop()).
  void check() const;
  // Blocks until every watched collective completed or failed (close()).
  void drain(std::chrono::milliseconds deadline);
  // Ends and joins the thread; an abort in progress completes first. After it,
  // the watchdog makes no call on the communicator. Idempotent.
  void stop();
  // Collectives watched and not yet complete (tests).
  size_t in_flight() const;

 private:
  struct Entry {
    std::shared_ptr<cudaEvent_t> done;
    std::chrono::steady_clock::time_point deadline;
    std::string what;
  };
  void run();

  void fail(const std::string& why);  // records `why` (the first failure wins), then aborts

  std::shared_ptr<NcclComm> comm_;
  EventQuery query_;
  SelectDevice select_device_;
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<Entry> in_flight_;
  std::string error_;
  bool stop_ = false;
  std::mutex join_mutex_;  // stop() from two threads joins once
  std::thread thread_;
};

}  // namespace fused_reducer::cuda
