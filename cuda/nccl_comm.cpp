#include "nccl_comm.h"

#include <algorithm>
#include <sstream>
#include <stdexcept>

#include "cuda_check.h"

namespace fused_reducer::cuda {
namespace {

constexpr auto kPollInterval = std::chrono::microseconds(50);
constexpr auto kWatchInterval = std::chrono::milliseconds(1);
constexpr auto kDestructorDeadline = std::chrono::seconds(5);

std::string describe(ncclResult_t result, const std::string& call, const char* file, int line,
                     const char* detail) {
  std::ostringstream msg;
  msg << "FusedReducer: NCCL call " << call << " failed at " << file << ":" << line << ": "
      << ncclGetErrorString(result);
  if (detail != nullptr && detail[0] != '\0') {
    msg << " (" << detail << ")";
  }
  msg << ". Set NCCL_DEBUG=INFO for NCCL's own log.";
  return msg.str();
}

// For calls on no communicator (ids, version). ncclInProgress is not an error
// for a non-blocking communicator: the caller then polls with wait_until_done.
#define FR_NCCL_CHECK(call)                                                                \
  do {                                                                                     \
    const ncclResult_t fr_result_ = (call);                                                \
    if (fr_result_ != ncclSuccess && fr_result_ != ncclInProgress) {                       \
      throw std::runtime_error(                                                            \
          describe(fr_result_, #call, __FILE__, __LINE__, ncclGetLastError(nullptr)));     \
    }                                                                                      \
  } while (0)

ncclResult_t real_all_reduce(const void* send, void* recv, size_t count, ncclDataType_t type,
                             ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  return ncclAllReduce(send, recv, count, type, op, comm, stream);
}
ncclResult_t real_reduce_scatter(const void* send, void* recv, size_t recv_count,
                                 ncclDataType_t type, ncclRedOp_t op, ncclComm_t comm,
                                 cudaStream_t stream) {
  return ncclReduceScatter(send, recv, recv_count, type, op, comm, stream);
}
ncclResult_t real_all_gather(const void* send, void* recv, size_t send_count, ncclDataType_t type,
                             ncclComm_t comm, cudaStream_t stream) {
  return ncclAllGather(send, recv, send_count, type, comm, stream);
}
ncclResult_t real_get_async_error(ncclComm_t comm, ncclResult_t* state) {
  return ncclCommGetAsyncError(comm, state);
}
ncclResult_t real_finalize(ncclComm_t comm) { return ncclCommFinalize(comm); }
ncclResult_t real_destroy(ncclComm_t comm) { return ncclCommDestroy(comm); }
ncclResult_t real_abort(ncclComm_t comm) { return ncclCommAbort(comm); }
const char* real_last_error(ncclComm_t comm) { return ncclGetLastError(comm); }

}  // namespace

std::string nccl_unique_id() {
  ncclUniqueId id;
  FR_NCCL_CHECK(ncclGetUniqueId(&id));
  return std::string(id.internal, sizeof(id.internal));
}

const NcclApi& real_nccl_api() {
  static const NcclApi api{real_all_reduce,     real_get_async_error, real_finalize,
                           real_destroy,        real_abort,           real_last_error,
                           real_reduce_scatter, real_all_gather};
  return api;
}

size_t nccl_type_bytes(ncclDataType_t type) {
  switch (type) {
    case ncclInt8:
    case ncclUint8: return 1;
    case ncclFloat16:
    case ncclBfloat16: return 2;
    case ncclInt32:
    case ncclUint32:
    case ncclFloat32: return 4;
    case ncclInt64:
    case ncclUint64:
    case ncclFloat64: return 8;
    default:
      throw std::runtime_error("FusedReducer: NCCL data type " +
                               std::to_string(static_cast<int>(type)) + " has no known size");
  }
}

int nccl_version() {
  int version = 0;
  FR_NCCL_CHECK(ncclGetVersion(&version));
  return version;
}

// ---------------------------------------------------------------------------
// NcclComm
// ---------------------------------------------------------------------------

NcclComm::NcclComm(const std::string& unique_id, int rank, int world_size, int device,
                   std::chrono::milliseconds timeout)
    : api_(&real_nccl_api()), rank_(rank), world_size_(world_size), device_(device) {
  if (unique_id.size() != sizeof(ncclUniqueId::internal)) {
    throw std::runtime_error("FusedReducer: an NCCL unique id has " +
                             std::to_string(sizeof(ncclUniqueId::internal)) + " bytes, got " +
                             std::to_string(unique_id.size()));
  }
  ncclUniqueId id;
  std::copy(unique_id.begin(), unique_id.end(), id.internal);
  FR_CUDA_CHECK(cudaSetDevice(device_));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // so that a missing peer times out instead of hanging
  ncclComm_t comm = nullptr;
  const ncclResult_t result = ncclCommInitRankConfig(&comm, world_size_, id, rank_, &config);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    comm_ = comm;
  }
  try {
    if (result != ncclSuccess && result != ncclInProgress) {
      throw std::runtime_error(describe(result, "ncclCommInitRankConfig", __FILE__, __LINE__,
                                        ncclGetLastError(comm)));
    }
    wait_until_done("creating the NCCL communicator (waiting for every rank to join)", timeout);
  } catch (...) {
    abort();  // never leak a communicator that failed to initialise
    throw;
  }
}

NcclComm::NcclComm(const NcclApi& api, ncclComm_t comm, int rank, int world_size, int device)
    : api_(&api), comm_(comm), rank_(rank), world_size_(world_size), device_(device) {}

NcclComm::~NcclComm() {
  close(kDestructorDeadline);
}

void NcclComm::abort() {
  std::lock_guard<std::mutex> lock(mutex_);
  abort_locked();
}

void NcclComm::abort_locked() {
  if (comm_ == nullptr) {
    return;  // already released (aborted, or destroyed by close())
  }
  const ncclComm_t comm = comm_;
  aborted_.store(true);  // before the release: see Note [Who may touch the communicator]
  comm_ = nullptr;
  api_->abort(comm);  // never waits for peers
}

ncclResult_t NcclComm::async_error() const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (comm_ == nullptr) {
    return ncclInvalidUsage;
  }
  ncclResult_t state = ncclSuccess;
  const ncclResult_t call = api_->get_async_error(comm_, &state);
  return call == ncclSuccess ? state : call;
}

std::string NcclComm::last_error() const {
  std::lock_guard<std::mutex> lock(mutex_);
  const char* detail = api_->last_error(comm_);  // nullptr: the last error of any communicator
  return detail != nullptr ? detail : "";
}

std::string NcclComm::gone_locked(const std::string& what) const {
  return "FusedReducer: the NCCL communicator (rank " + std::to_string(rank_) + " of " +
         std::to_string(world_size_) + ") was " +
         (closed_.load() ? std::string("closed") : std::string("aborted after an earlier error")) +
         " while " + what + "; construct a new FusedReducer";
}

void NcclComm::wait_until_done(const std::string& what, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (true) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (comm_ == nullptr) {
        throw std::runtime_error(gone_locked(what));  // the watchdog aborted it between polls
      }
      ncclResult_t state = ncclSuccess;
      const ncclResult_t call = api_->get_async_error(comm_, &state);
      if (call != ncclSuccess) {
        state = call;
      }
      if (state == ncclSuccess) {
        return;
      }
      if (state != ncclInProgress) {
        const std::string why =
            describe(state, what, __FILE__, __LINE__, api_->last_error(comm_));
        abort_locked();
        throw std::runtime_error(why);
      }
      if (std::chrono::steady_clock::now() > deadline) {
        abort_locked();
        throw std::runtime_error("FusedReducer: timed out after " +
                                 std::to_string(timeout.count()) + " ms " + what +
                                 "; the NCCL communicator (rank " + std::to_string(rank_) +
                                 " of " + std::to_string(world_size_) +
                                 ") was aborted. A peer rank may have died or be stuck.");
      }
    }
    std::this_thread::sleep_for(kPollInterval);  // without the lock: the watchdog may abort
  }
}

void NcclComm::launch(const std::string& what, const char* call_name,
                      const std::function<ncclResult_t(ncclComm_t)>& call,
                      std::chrono::milliseconds timeout) {
  std::lock_guard<std::mutex> operation(op_mutex_);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (comm_ == nullptr || closed_.load()) {
      throw std::runtime_error(gone_locked("starting " + what));
    }
    const ncclResult_t result = call(comm_);
    if (result != ncclSuccess && result != ncclInProgress) {
      throw std::runtime_error(
          describe(result, call_name, __FILE__, __LINE__, api_->last_error(comm_)));
    }
  }
  wait_until_done("enqueuing " + what, timeout);  // enqueue only: no wait for the GPU
}

void NcclComm::allreduce(void* data, size_t count, ncclDataType_t type, ncclRedOp_t op,
                         cudaStream_t stream, std::chrono::milliseconds timeout) {
  launch("an all-reduce", "ncclAllReduce",
         [&](ncclComm_t comm) {
           return api_->all_reduce(data, data, count, type, op, comm, stream);
         },
         timeout);
}

void* NcclComm::own_shard(void* data, size_t count, ncclDataType_t type) const {
  return static_cast<char*>(data) + static_cast<size_t>(rank_) * count * nccl_type_bytes(type);
}

void NcclComm::reduce_scatter(void* data, size_t count, ncclDataType_t type, ncclRedOp_t op,
                              cudaStream_t stream, std::chrono::milliseconds timeout) {
  if (api_->reduce_scatter == nullptr) {
    throw std::runtime_error("FusedReducer: this NCCL API has no reduce-scatter");
  }
  void* shard = own_shard(data, count, type);
  launch("a reduce-scatter", "ncclReduceScatter",
         [&](ncclComm_t comm) {
           return api_->reduce_scatter(data, shard, count, type, op, comm, stream);
         },
         timeout);
}

void NcclComm::all_gather(void* data, size_t count, ncclDataType_t type, cudaStream_t stream,
                          std::chrono::milliseconds timeout) {
  if (api_->all_gather == nullptr) {
    throw std::runtime_error("FusedReducer: this NCCL API has no all-gather");
  }
  const void* shard = own_shard(data, count, type);
  launch("an all-gather", "ncclAllGather",
         [&](ncclComm_t comm) { return api_->all_gather(shard, data, count, type, comm, stream); },
         timeout);
}

bool NcclComm::close(std::chrono::milliseconds deadline) {
  std::lock_guard<std::mutex> operation(op_mutex_);
  ncclResult_t started;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (comm_ == nullptr || closed_.exchange(true)) {
      return false;  // never opened, already closed, or abort already released it
    }
    started = api_->finalize(comm_);
  }
  ncclResult_t state = started == ncclSuccess || started == ncclInProgress ? ncclInProgress
                                                                            : started;
  const auto until = std::chrono::steady_clock::now() + deadline;
  while (state == ncclInProgress) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (comm_ == nullptr) {
        return false;  // aborted by another thread between polls
      }
      const ncclResult_t call = api_->get_async_error(comm_, &state);
      if (call != ncclSuccess) {
        state = call;
      }
    }
    if (state != ncclInProgress || std::chrono::steady_clock::now() >= until) {
      break;
    }
    std::this_thread::sleep_for(kPollInterval);  // without the lock
  }
  std::lock_guard<std::mutex> lock(mutex_);
  if (comm_ == nullptr) {
    return false;
  }
  if (state != ncclSuccess) {
    abort_locked();  // a dead or stuck peer: never wait for it
    return false;
  }
  const ncclComm_t comm = comm_;
  aborted_.store(true);  // released: no further NCCL call on it, set before the destroy
  comm_ = nullptr;
  api_->destroy(comm);
  return true;
}

std::string capture_refusal(cudaStreamCaptureStatus status, int device) {
  if (status == cudaStreamCaptureStatusNone) {
    return "";
  }
  return std::string("FusedReducer: the gradient all-reduce on cuda:") + std::to_string(device) +
         " was reached while the current CUDA stream is " +
         (status == cudaStreamCaptureStatusActive ? "being captured into a CUDA graph"
                                                  : "in an invalidated CUDA graph capture") +
         " (torch.cuda.graph, torch.cuda.make_graphed_callables or torch.compile(mode="
         "\"reduce-overhead\")). The NCCL transport cannot run inside a capture (its collectives "
         "are watched by polling their events, which breaks the capture). Capture only the "
         "forward and backward of the module itself and call FusedReducer outside the graph, or "
         "use torch.compile without mode=\"reduce-overhead\".";
}

// ---------------------------------------------------------------------------
// Watchdog
// ---------------------------------------------------------------------------

Watchdog::Watchdog(std::shared_ptr<NcclComm> comm, EventQuery query, SelectDevice select_device)
    : comm_(std::move(comm)), query_(std::move(query)), select_device_(std::move(select_device)) {
  thread_ = std::thread([this] { run(); });
}

Watchdog::~Watchdog() {
  stop();
}

void Watchdog::stop() {
  std::lock_guard<std::mutex> join(join_mutex_);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) {
    thread_.join();
  }
  std::lock_guard<std::mutex> lock(mutex_);
  in_flight_.clear();  // nobody watches them any more
  wake_.notify_all();  // drain()
}

void Watchdog::watch(std::shared_ptr<cudaEvent_t> done, std::chrono::milliseconds timeout,
                     std::string what) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stop_) {
      return;
    }
    in_flight_.push_back({std::move(done), std::chrono::steady_clock::now() + timeout,
                          std::move(what)});
  }
  wake_.notify_all();
}

void Watchdog::check() const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!error_.empty()) {
    throw std::runtime_error(error_);
  }
}

size_t Watchdog::in_flight() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return in_flight_.size();
}

void Watchdog::drain(std::chrono::milliseconds deadline) {
  const auto until = std::chrono::steady_clock::now() + deadline;
  std::unique_lock<std::mutex> lock(mutex_);
  wake_.wait_until(lock, until, [this] { return in_flight_.empty() || !error_.empty(); });
}

// Called without mutex_ held.
void Watchdog::fail(const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (error_.empty()) {  // the first failure is the one reported
      error_ = why + "; the NCCL communicator (rank " + std::to_string(comm_->rank()) + " of " +
               std::to_string(comm_->world_size()) +
               ") was aborted. A peer rank may have died or be stuck; construct a new "
               "FusedReducer to go on.";
    }
    in_flight_.clear();
    wake_.notify_all();  // drain()
  }
  // Recorded first, so an owner that finds the communicator aborted also finds this error; the
  // abort itself takes the communicator's lock.
  comm_->abort();
}

void Watchdog::run() {
  // Event queries and the abort must run on the communicator's device.
  if (const cudaError_t selected = select_device_(comm_->device()); selected != cudaSuccess) {
    fail("the NCCL watchdog could not select cuda:" + std::to_string(comm_->device()) + " (" +
         cudaGetErrorString(selected) + "), so no collective could be watched");
    std::unique_lock<std::mutex> lock(mutex_);
    wake_.wait(lock, [this] { return stop_; });
    return;
  }
  // See Note [No NCCL collective under graph capture]: this thread's event queries must not
  // invalidate a capture another thread runs (in torch's default, global mode). Best effort: it
  // cannot fail once the device is selected.
  cudaStreamCaptureMode relaxed = cudaStreamCaptureModeRelaxed;
  cudaThreadExchangeStreamCaptureMode(&relaxed);
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stop_) {
    if (in_flight_.empty()) {
      wake_.wait(lock, [this] { return stop_ || !in_flight_.empty(); });
      continue;
    }
    // Collectives on one stream complete in order: the oldest decides. Only
    // this thread removes entries (stop() after joining it), so `oldest` stays
    // the front while the lock is released for the queries: the communicator
    // is polled without holding this mutex (lock order, and check() and
    // watch() never wait behind NCCL).
    const Entry oldest = in_flight_.front();
    lock.unlock();
    std::string why;
    const cudaError_t query = query_(*oldest.done);
    if (query == cudaSuccess) {
      // done
    } else if (query != cudaErrorNotReady) {
      why = oldest.what + " failed on the GPU: " + cudaGetErrorString(query);
    } else if (const ncclResult_t state = comm_->async_error();
               state != ncclSuccess && state != ncclInProgress) {
      why = oldest.what + ": NCCL reported an asynchronous error: " +
            std::string(ncclGetErrorString(state)) + " (" + comm_->last_error() + ")";
    } else if (std::chrono::steady_clock::now() > oldest.deadline) {
      why = oldest.what + " did not complete within its timeout";
    }
    if (!why.empty()) {
      fail(why);
      lock.lock();
      continue;
    }
    lock.lock();
    if (query == cudaSuccess) {
      in_flight_.pop_front();
      if (in_flight_.empty()) {
        wake_.notify_all();  // drain()
      }
      continue;
    }
    wake_.wait_for(lock, kWatchInterval, [this] { return stop_; });
  }
}

}  // namespace fused_reducer::cuda
