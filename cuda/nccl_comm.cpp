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

std::string describe(ncclResult_t result, const char* call, const char* file, int line,
                     ncclComm_t comm) {
  std::ostringstream msg;
  msg << "FusedReducer: NCCL call " << call << " failed at " << file << ":" << line << ": "
      << ncclGetErrorString(result);
  const char* detail = ncclGetLastError(comm);
  if (detail != nullptr && detail[0] != '\0') {
    msg << " (" << detail << ")";
  }
  msg << ". Set NCCL_DEBUG=INFO for NCCL's own log.";
  return msg.str();
}

// ncclInProgress is not an error for a non-blocking communicator: the caller
// then polls with wait_until_done.
#define FR_NCCL_CHECK(call, comm)                                                      \
  do {                                                                                 \
    const ncclResult_t fr_result_ = (call);                                            \
    if (fr_result_ != ncclSuccess && fr_result_ != ncclInProgress) {                   \
      throw std::runtime_error(describe(fr_result_, #call, __FILE__, __LINE__, (comm))); \
    }                                                                                  \
  } while (0)

}  // namespace

std::string nccl_unique_id() {
  ncclUniqueId id;
  FR_NCCL_CHECK(ncclGetUniqueId(&id), nullptr);
  return std::string(id.internal, sizeof(id.internal));
}

int nccl_version() {
  int version = 0;
  FR_NCCL_CHECK(ncclGetVersion(&version), nullptr);
  return version;
}

// ---------------------------------------------------------------------------
// NcclComm
// ---------------------------------------------------------------------------

NcclComm::NcclComm(const std::string& unique_id, int rank, int world_size, int device,
                   std::chrono::milliseconds timeout)
    : rank_(rank), world_size_(world_size), device_(device) {
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
  const ncclResult_t result = ncclCommInitRankConfig(&comm_, world_size_, id, rank_, &config);
  try {
    if (result != ncclSuccess && result != ncclInProgress) {
      throw std::runtime_error(
          describe(result, "ncclCommInitRankConfig", __FILE__, __LINE__, comm_));
    }
    wait_until_done("creating the NCCL communicator (waiting for every rank to join)", timeout);
  } catch (...) {
    abort();  // never leak a communicator that failed to initialise
    throw;
  }
}

NcclComm::~NcclComm() {
  close(kDestructorDeadline);
}

void NcclComm::abort() {
  if (comm_ != nullptr && !aborted_.exchange(true)) {
    ncclCommAbort(comm_);  // never waits for peers
  }
}

ncclResult_t NcclComm::async_error() const {
  if (aborted_.load()) {
    return ncclInvalidUsage;
  }
  ncclResult_t state = ncclSuccess;
  const ncclResult_t call = ncclCommGetAsyncError(comm_, &state);
  return call == ncclSuccess ? state : call;
}

std::string NcclComm::last_error() const {
  const char* detail = ncclGetLastError(aborted_.load() ? nullptr : comm_);
  return detail != nullptr ? detail : "";
}

void NcclComm::wait_until_done(const char* what, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (true) {
    const ncclResult_t state = async_error();
    if (state == ncclSuccess) {
      return;
    }
    if (state != ncclInProgress) {
      const std::string why = describe(state, what, __FILE__, __LINE__, comm_);
      abort();
      throw std::runtime_error(why);
    }
    if (std::chrono::steady_clock::now() > deadline) {
      abort();
      throw std::runtime_error("FusedReducer: timed out after " + std::to_string(timeout.count()) +
                               " ms " + what + "; the NCCL communicator (rank " +
                               std::to_string(rank_) + " of " + std::to_string(world_size_) +
                               ") was aborted. A peer rank may have died or be stuck.");
    }
    std::this_thread::sleep_for(kPollInterval);
  }
}

void NcclComm::allreduce(void* data, size_t count, ncclDataType_t type, ncclRedOp_t op,
                         cudaStream_t stream, std::chrono::milliseconds timeout) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (aborted_.load() || closed_.load()) {
    throw std::runtime_error("FusedReducer: the NCCL communicator was " +
                             std::string(aborted_.load() ? "aborted after an earlier error"
                                                         : "closed") +
                             "; construct a new FusedReducer");
  }
  FR_NCCL_CHECK(ncclAllReduce(data, data, count, type, op, comm_, stream), comm_);
  wait_until_done("enqueuing an all-reduce", timeout);  // enqueue only: no wait for the GPU
}

bool NcclComm::close(std::chrono::milliseconds deadline) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (comm_ == nullptr || closed_.exchange(true)) {
    return false;
  }
  if (aborted_.load()) {
    return false;  // abort already released it
  }
  bool clean = false;
  const ncclResult_t started = ncclCommFinalize(comm_);
  if (started == ncclSuccess || started == ncclInProgress) {
    const auto until = std::chrono::steady_clock::now() + deadline;
    ncclResult_t state = ncclInProgress;
    while (state == ncclInProgress && std::chrono::steady_clock::now() < until) {
      state = async_error();
      if (state == ncclInProgress) {
        std::this_thread::sleep_for(kPollInterval);
      }
    }
    clean = state == ncclSuccess;
  }
  if (clean) {
    ncclCommDestroy(comm_);
    aborted_.store(true);  // released: no further NCCL call on it
  } else {
    abort();  // a dead or stuck peer: never wait for it
  }
  return clean;
}

// ---------------------------------------------------------------------------
// Watchdog
// ---------------------------------------------------------------------------

Watchdog::Watchdog(std::shared_ptr<NcclComm> comm) : comm_(std::move(comm)) {
  thread_ = std::thread([this] { run(); });
}

Watchdog::~Watchdog() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

void Watchdog::watch(std::shared_ptr<cudaEvent_t> done, std::chrono::milliseconds timeout,
                     std::string what) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
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

void Watchdog::drain(std::chrono::milliseconds deadline) {
  const auto until = std::chrono::steady_clock::now() + deadline;
  std::unique_lock<std::mutex> lock(mutex_);
  wake_.wait_until(lock, until, [this] { return in_flight_.empty() || !error_.empty(); });
}

void Watchdog::fail(const std::string& why) {
  // Called with mutex_ held. The first failure is the one reported.
  if (error_.empty()) {
    error_ = why + "; the NCCL communicator (rank " + std::to_string(comm_->rank()) + " of " +
             std::to_string(comm_->world_size()) + ") was aborted. A peer rank may have died or "
             "be stuck; construct a new FusedReducer to go on.";
  }
  in_flight_.clear();
  comm_->abort();
}

void Watchdog::run() {
  cudaSetDevice(comm_->device());
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stop_) {
    if (in_flight_.empty()) {
      wake_.wait(lock, [this] { return stop_ || !in_flight_.empty(); });
      continue;
    }
    // Collectives on one stream complete in order: the oldest decides.
    Entry& oldest = in_flight_.front();
    const cudaError_t query = cudaEventQuery(*oldest.done);
    if (query == cudaSuccess) {
      in_flight_.pop_front();
      if (in_flight_.empty()) {
        wake_.notify_all();  // drain()
      }
      continue;
    }
    if (query != cudaErrorNotReady) {
      fail(oldest.what + " failed on the GPU: " + cudaGetErrorString(query));
    } else if (const ncclResult_t state = comm_->async_error();
               state != ncclSuccess && state != ncclInProgress) {
      fail(oldest.what + ": NCCL reported an asynchronous error: " +
           std::string(ncclGetErrorString(state)) + " (" + comm_->last_error() + ")");
    } else if (std::chrono::steady_clock::now() > oldest.deadline) {
      fail(oldest.what + " did not complete within its timeout");
    }
    if (!error_.empty()) {
      wake_.notify_all();
      continue;
    }
    wake_.wait_for(lock, kWatchInterval, [this] { return stop_; });
  }
}

}  // namespace fused_reducer::cuda
