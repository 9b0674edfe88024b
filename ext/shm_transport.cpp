#include "shm_transport.h"

#include <ATen/Dispatch.h>
#include <ATen/record_function.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

#include "transport_registry.h"
namespace fused_reducer {

// The worker thread and everything it shares with the callers: on the heap,
// abandoned in a forked child. See Note [Shared-memory transport in a forked child].
struct ShmTransport::Runtime {
  std::mutex mutex;
  std::condition_variable queued;
  std::deque<std::shared_ptr<Job>> queue;
  bool stopping = false;
  bool closing = false;  // a close() is under way (a second caller waits for it)
  bool closed = false;
  std::condition_variable closed_cv;
  std::atomic<int64_t> abort_after{INT64_MAX};  // See shm::WaitLimits::abort_after_ns
  std::string error;  // first failure; every later bucket fails with it
  std::thread worker;
};

// See Note [Shared-memory jobs and their buckets].
struct ShmTransport::Job {
  shm::Collective op = shm::Collective::kAllReduce;
  char* data = nullptr;         // the bucket: owned by the PendingShm, not by the job
  int64_t numel = 0;            // elements of `sum_dtype`
  at::ScalarType sum_dtype{};   // complex buckets are summed as (re, im) pairs of reals
                                // (an all-gather moves elements of `dtype`: sum_dtype == dtype)
  int64_t check_numel = 0;      // the caller's count and dtype, compared across ranks
  at::ScalarType dtype{};
  pid_t owner = 0;

  std::mutex mutex;
  std::condition_variable finished;
  bool cancelled = false;                 // under `mutex`: the bucket is not ours to touch
  std::atomic<bool> cancel_flag{false};   // the same, polled by the waits without the lock
  std::atomic<bool> done{false};
  std::atomic<int> waiting_for{-1};       // the rank the worker waits for (-1: none)
  std::string error;

  void cancel() {
    cancelled = true;
    cancel_flag.store(true);
  }
};

namespace {

class PendingShm : public PendingCollective {
 public:
  PendingShm(at::Tensor flat, std::shared_ptr<ShmTransport::Job> job)
      : flat_(std::move(flat)), job_(std::move(job)) {}

  // Dropped unwaited: the worker must not touch the bucket once it is released.
  ~PendingShm() override {
    if (getpid() != job_->owner) return;  // a forked child: no lock may be taken
    std::lock_guard<std::mutex> lock(job_->mutex);
    if (!job_->done.load()) job_->cancel();
  }

  bool completed() override { return job_->done.load(std::memory_order_acquire); }

  void wait(std::chrono::milliseconds timeout) override {
    const std::string op = shm::collective_name(static_cast<int32_t>(job_->op));
    if (getpid() != job_->owner) {
      throw std::runtime_error(
          "shm " + op + " waited for in a forked child (pid " + std::to_string(getpid()) +
          ") of the process that started it; only that process can reduce");
    }
    timeout = shm::clamp_timeout(timeout);
    std::unique_lock<std::mutex> lock(job_->mutex);
    if (!job_->finished.wait_for(lock, timeout, [&] { return job_->done.load(); })) {
      // Under the job's lock: the worker is not inside the bucket now and never enters it again.
      job_->cancel();
      const int missing = job_->waiting_for.load();
      throw std::runtime_error(
          "timed out after " + std::to_string(timeout.count()) + " ms" +
          (missing >= 0 ? " waiting for rank " + std::to_string(missing)
                        : " (earlier collectives still running, or this " + op +
                              " not yet started)") +
          "; the " + op + " was cancelled (nothing is written into the bucket any more, and "
          "the peers' " + op + " fails too). Raise the FusedReducer's timeout if the ranks are "
          "just slow");
    }
    if (!job_->error.empty()) {
      throw std::runtime_error(job_->error);
    }
  }

 private:
  at::Tensor flat_;
  std::shared_ptr<ShmTransport::Job> job_;
};

std::string dtype_name(int32_t code) {
  if (code >= 0 && code < static_cast<int32_t>(at::ScalarType::NumOptions)) {
    return c10::toString(static_cast<at::ScalarType>(code));
  }
  return "an unknown dtype (" + std::to_string(code) + ")";
}

// The real type complex buckets are summed in, as (re, im) pairs.
at::ScalarType sum_dtype_of(at::ScalarType dtype) {
  switch (dtype) {
    case at::kComplexFloat: return at::kFloat;
    case at::kComplexDouble: return at::kDouble;
    case at::kComplexHalf: return at::kHalf;
    default: return dtype;
  }
}

// Half types accumulate in float and round once, which for two ranks is exactly
// what a half-precision add gives.
template <typename T>
void sum_half(T* out, const std::vector<const T*>& in, int64_t n) {
  constexpr int64_t kBlock = 512;
  float acc[kBlock];
  for (int64_t start = 0; start < n; start += kBlock) {
    const int64_t len = std::min(kBlock, n - start);
    for (int64_t i = 0; i < len; ++i) acc[i] = static_cast<float>(in[0][start + i]);
    for (size_t r = 1; r < in.size(); ++r) {
      for (int64_t i = 0; i < len; ++i) acc[i] += static_cast<float>(in[r][start + i]);
    }
    for (int64_t i = 0; i < len; ++i) out[start + i] = static_cast<T>(acc[i]);
  }
}

template <typename T>
void sum_slots(char* out, const std::vector<const char*>& in, int64_t n) {
  std::vector<const T*> typed(in.size());
  for (size_t r = 0; r < in.size(); ++r) typed[r] = reinterpret_cast<const T*>(in[r]);
  if constexpr (std::is_same_v<T, c10::Half> || std::is_same_v<T, c10::BFloat16>) {
    sum_half(reinterpret_cast<T*>(out), typed, n);
  } else {
    shm::sum_inputs(reinterpret_cast<T*>(out), typed, n);
  }
}

}  // namespace

ShmTransport::ShmTransport(const std::string& name, bool create, int rank, int world_size,
                           int64_t chunk_bytes, std::chrono::milliseconds timeout)
    : rank_(rank), world_(world_size), timeout_(shm::clamp_timeout(timeout)) {
  TORCH_CHECK(world_size >= 1 && world_size <= shm::kMaxWorld,
              "FusedReducer shm transport: world size ", world_size, " is outside 1..",
              shm::kMaxWorld, "; use backend='process_group'");
  TORCH_CHECK(rank >= 0 && rank < world_size, "FusedReducer shm transport: rank ", rank,
              " outside the world of ", world_size);
  try {
    segment_ = create ? shm::Segment::create(name, world_size, chunk_bytes)
                      : shm::Segment::attach(name, world_size, chunk_bytes);
  } catch (const shm::Error& e) {
    TORCH_CHECK(false, "FusedReducer shm transport (rank ", rank, "): ", e.what());
  }
  owner_pid_ = getpid();
  segment_->register_rank(rank);
  runtime_ = new Runtime();
  runtime_->worker = std::thread([this] { run_worker(); });
}

bool ShmTransport::in_forked_child() const { return getpid() != owner_pid_; }

ShmTransport::~ShmTransport() {
  if (in_forked_child()) {
    // Abandoned, not destroyed: See Note [Shared-memory transport in a forked child].
    (void)segment_.release();
    runtime_ = nullptr;
    return;
  }
  close(std::chrono::milliseconds(10000));
  delete runtime_;
}

void ShmTransport::unlink() { segment_->unlink(); }

void ShmTransport::start_peer_checks() { check_peers_ = segment_->peers_watchable(); }

std::unique_ptr<PendingCollective> ShmTransport::allreduce_sum(at::Tensor& flat) {
  return start(flat, shm::Collective::kAllReduce);
}

std::unique_ptr<PendingCollective> ShmTransport::reduce_scatter_sum(at::Tensor& flat,
                                                                    const std::string& label) {
  (void)label;  // errors are raised by wait(), whose caller names the bucket
  return start(flat, shm::Collective::kReduceScatter);
}

std::unique_ptr<PendingCollective> ShmTransport::all_gather(at::Tensor& flat,
                                                            const std::string& label) {
  (void)label;
  return start(flat, shm::Collective::kAllGather);
}

std::unique_ptr<PendingCollective> ShmTransport::start(at::Tensor& flat, shm::Collective op) {
  const std::string what = shm::collective_name(static_cast<int32_t>(op));
  TORCH_CHECK(!in_forked_child(), "FusedReducer shm transport: ", what,
              " in a forked child (pid ", getpid(), ") of the training process; a DataLoader "
              "worker or other child cannot take part in the parent's collectives");
  TORCH_CHECK(flat.device().is_cpu() && flat.is_contiguous(),
              "FusedReducer shm transport: buckets must be contiguous CPU tensors; got ",
              flat.device(), flat.is_contiguous() ? "" : " (not contiguous)");
  TORCH_CHECK(!flat.is_conj() && !flat.is_neg(),
              "FusedReducer shm transport: the bucket is a lazily conjugated or negated view; "
              "call .resolve_conj().resolve_neg() first");
  const bool sharded = op != shm::Collective::kAllReduce;
  TORCH_CHECK(!sharded || flat.numel() % world_ == 0, "FusedReducer shm transport: the ", what,
              " needs a bucket whose number of elements is a multiple of the world size (each "
              "of the ", world_, " ranks owns an equal shard); got ", flat.numel(),
              " elements (", flat.numel(), " % ", world_, " = ", flat.numel() % world_, ")");
  const auto dtype = flat.scalar_type();
  // An all-gather only moves bytes: any dtype, element by element.
  const auto sum_dtype = op == shm::Collective::kAllGather ? dtype : sum_dtype_of(dtype);
  const bool summable = sum_dtype == at::kFloat || sum_dtype == at::kDouble ||
                        sum_dtype == at::kHalf || sum_dtype == at::kBFloat16 ||
                        sum_dtype == at::kByte || sum_dtype == at::kChar ||
                        sum_dtype == at::kShort || sum_dtype == at::kInt || sum_dtype == at::kLong;
  TORCH_CHECK(op == shm::Collective::kAllGather || summable,
              "FusedReducer shm transport sums floating-point, complex and integer buckets, not ",
              dtype, "; use backend='process_group'");
  // Named as the backends name theirs ("gloo:all_reduce"), so profilers count it alike.
  const char* event = op == shm::Collective::kAllReduce       ? "shm:all_reduce"
                      : op == shm::Collective::kReduceScatter ? "shm:reduce_scatter"
                                                              : "shm:all_gather";
  RECORD_FUNCTION(event, std::vector<c10::IValue>({flat}));
  auto job = std::make_shared<Job>();
  job->op = op;
  job->data = static_cast<char*>(flat.data_ptr());
  job->check_numel = flat.numel();
  job->dtype = dtype;
  job->sum_dtype = sum_dtype;
  job->numel = flat.numel() * (sum_dtype != dtype ? 2 : 1);
  job->owner = owner_pid_;
  {
    std::lock_guard<std::mutex> lock(runtime_->mutex);
    TORCH_CHECK(!runtime_->stopping, "FusedReducer shm transport: ", what, " after close()");
    runtime_->queue.push_back(job);
  }
  runtime_->queued.notify_one();
  return std::make_unique<PendingShm>(flat, std::move(job));
}

void ShmTransport::check() {
  if (in_forked_child()) return;  // nothing of the parent's to report, and no lock to take
  std::lock_guard<std::mutex> lock(runtime_->mutex);
  if (!runtime_->error.empty()) {
    throw std::runtime_error(runtime_->error);
  }
}

void ShmTransport::close(std::chrono::milliseconds deadline) {
  if (in_forked_child()) {
    return;  // the worker thread and the peers are the parent's
  }
  Runtime& rt = *runtime_;
  {
    std::unique_lock<std::mutex> lock(rt.mutex);
    if (rt.closing) {  // another thread closes: return once it has
      rt.closed_cv.wait(lock, [&] { return rt.closed; });
      return;
    }
    rt.closing = true;
    rt.stopping = true;
  }
  // Buckets already started get until the deadline; then the worker's waits give up.
  const auto now = std::chrono::steady_clock::now().time_since_epoch();
  const auto grace = std::chrono::duration_cast<std::chrono::nanoseconds>(
      shm::clamp_timeout(deadline));
  rt.abort_after = static_cast<int64_t>(now.count()) + grace.count();
  rt.queued.notify_all();
  rt.worker.join();
  // Peers still waiting for this rank fail at once instead of at their timeout.
  segment_->stop(rank_);
  {
    std::lock_guard<std::mutex> lock(rt.mutex);
    rt.closed = true;
  }
  rt.closed_cv.notify_all();
}

void ShmTransport::fail(const std::string& error) {
  {
    std::lock_guard<std::mutex> lock(runtime_->mutex);
    if (runtime_->error.empty()) runtime_->error = error;
  }
  segment_->stop(rank_);
}

void ShmTransport::run_worker() {
  Runtime& rt = *runtime_;
  while (true) {
    std::shared_ptr<Job> job;
    std::string failure;
    {
      std::unique_lock<std::mutex> lock(rt.mutex);
      rt.queued.wait(lock, [&] { return rt.stopping || !rt.queue.empty(); });
      if (rt.queue.empty()) return;
      job = rt.queue.front();
      failure = rt.error;
    }
    const std::string op = shm::collective_name(static_cast<int32_t>(job->op));
    const std::string cancelled =
        std::string(job->op == shm::Collective::kAllReduce ? "an " : "a ") + op + " of rank " +
        std::to_string(rank_) +
        " was cancelled (its wait timed out, or it was dropped unwaited); the shared-memory "
        "transport stopped";
    if (failure.empty()) {
      try {
        reduce(*job);
      } catch (const shm::Cancelled& e) {
        failure = "rank " + std::to_string(rank_) + ": " + e.what();
        fail(cancelled);
      } catch (const std::exception& e) {
        failure = e.what();
        fail(failure);
      }
    }
    {
      std::lock_guard<std::mutex> lock(rt.mutex);
      rt.queue.pop_front();
    }
    bool cancelled_late = false;
    {
      std::lock_guard<std::mutex> lock(job->mutex);
      // Cancelled after its last copy: the caller was told it failed, so this rank stops too.
      cancelled_late = job->cancelled && failure.empty();
      job->error = failure;
      job->done = true;
    }
    job->finished.notify_all();
    if (cancelled_late) {
      fail(cancelled);
    }
  }
}

void ShmTransport::reduce(Job& job) {
  const int64_t element = c10::elementSize(job.sum_dtype);
  shm::BucketIo io;
  io.numel = job.numel;
  io.element_bytes = element;
  io.check_numel = job.check_numel;
  io.check_dtype = static_cast<int32_t>(job.dtype);
  io.dtype_name = dtype_name;
  // See Note [Shared-memory jobs and their buckets].
  io.copy_in = [&](char* slot, int64_t first, int64_t count) {
    std::lock_guard<std::mutex> lock(job.mutex);
    if (job.cancelled) throw shm::Cancelled("the bucket's wait gave up before its data was sent");
    std::memcpy(slot, job.data + first * element, count * element);
  };
  io.copy_out = [&](const char* slot, int64_t first, int64_t count) {
    std::lock_guard<std::mutex> lock(job.mutex);
    if (job.cancelled) throw shm::Cancelled("the bucket's wait gave up before the sum arrived");
    std::memcpy(job.data + first * element, slot, count * element);
  };
  if (job.op != shm::Collective::kAllGather) {  // an all-gather sums nothing
    AT_DISPATCH_ALL_TYPES_AND2(at::kHalf, at::kBFloat16, job.sum_dtype, "shm_sum", [&] {
      io.sum = sum_slots<scalar_t>;
    });
  }
  {
    std::lock_guard<std::mutex> lock(job.mutex);
    if (job.cancelled) throw shm::Cancelled("the bucket was dropped or its wait gave up before it started");
  }
  shm::WaitLimits limits;
  limits.timeout = timeout_;
  limits.abort_after_ns = &runtime_->abort_after;
  limits.cancelled = &job.cancel_flag;
  limits.check_peers = check_peers_;
  limits.waiting_for = &job.waiting_for;
  shm::run(*segment_, rank_, job.op, io, chunks_done_, limits);
}

// Made by transports/transport.py's shm_transport once every rank knows the segment's name.
FUSED_REDUCER_REGISTER_TRANSPORT("shm", [](const TransportArgs& args) {
  return std::make_shared<ShmTransport>(args.id, args.create, args.rank, args.world_size,
                                        args.chunk_bytes, args.timeout);
});

}  // namespace fused_reducer
