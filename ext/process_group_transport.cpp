#include "process_group_transport.h"

namespace fused_reducer {

bool stream_ordered_wait(c10::DeviceType device, const std::string& backend) {
  // Other backends on CUDA tensors (gloo) block the host in wait(); so may unknown ones: they
  // keep wait(timeout), which is correct, if slower.
  return device == c10::DeviceType::CUDA && backend == "nccl";
}

void WorkDeadlines::watch(c10::intrusive_ptr<c10d::Work> work, std::string what,
                          Clock::time_point launched, std::chrono::milliseconds timeout) {
  std::lock_guard<std::mutex> lock(mutex_);
  watched_.push_back({std::move(work), std::move(what), launched, timeout});
}

void WorkDeadlines::check() {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto now = Clock::now();
  for (auto it = watched_.begin(); it != watched_.end();) {
    if (it->work->isCompleted()) {  // non-blocking (an event query on NCCL)
      const auto error = it->work->exception();
      const std::string what = it->what;
      it = watched_.erase(it);
      if (error) {
        try {
          std::rethrow_exception(error);
        } catch (const std::exception& e) {
          throw std::runtime_error(what + " failed: " + e.what());
        }
      }
      continue;
    }
    if (it->timeout != ::kNoTimeout && now - it->launched > it->timeout) {
      // Kept: raised again by every later call until it completes (a stuck collective leaves
      // the group unusable, as the NCCL watchdog's error does).
      const auto running = std::chrono::duration_cast<std::chrono::milliseconds>(now - it->launched);
      throw std::runtime_error(it->what + " did not complete within " +
                               std::to_string(it->timeout.count()) + " ms (still running " +
                               std::to_string(running.count()) +
                               " ms after its launch); a peer rank may have died or stopped "
                               "calling backward");
    }
    ++it;
  }
}

PendingWork::PendingWork(c10::intrusive_ptr<c10d::Work> work, bool stream_ordered,
                         std::string what, std::shared_ptr<WorkDeadlines> deadlines)
    : work_(std::move(work)),
      stream_ordered_(stream_ordered),
      what_(std::move(what)),
      deadlines_(std::move(deadlines)) {}

void PendingWork::wait(std::chrono::milliseconds timeout) {
  if (!stream_ordered_) {
    // The host blocks here anyway (gloo): let the backend bound it.
    if (!work_->wait(timeout)) {
      throw std::runtime_error("timed out after " + std::to_string(timeout.count()) + " ms");
    }
    return;
  }
  // Raises for this collective if it is already past its deadline, or for an earlier one.
  deadlines_->watch(work_, what_, launched_, timeout);
  deadlines_->check();
  // kNoTimeout: only the current stream waits (a timeout would block the host until done).
  if (!work_->wait(::kNoTimeout)) {
    throw std::runtime_error(what_ + " was aborted");
  }
}

ProcessGroupTransport::ProcessGroupTransport(c10::intrusive_ptr<c10d::ProcessGroup> group)
    : group_(std::move(group)) {}

std::unique_ptr<PendingCollective> ProcessGroupTransport::allreduce_sum(at::Tensor& flat) {
  return allreduce(flat, "all-reduce #" + std::to_string(launched_ + 1));
}

std::unique_ptr<PendingCollective> ProcessGroupTransport::allreduce_sum_labeled(
    at::Tensor& flat, const std::string& label) {
  return allreduce(flat, "all-reduce of " + label);
}

std::unique_ptr<PendingCollective> ProcessGroupTransport::allreduce(at::Tensor& flat,
                                                                    const std::string& what) {
  deadlines_->check();  // an earlier collective past its deadline fails this step
  std::vector<at::Tensor> tensors{flat};
  c10d::AllreduceOptions options;
  options.reduceOp = c10d::ReduceOp::SUM;
  auto work = group_->allreduce(tensors, options);
  return pending(std::move(work), flat, what);
}

std::unique_ptr<PendingCollective> ProcessGroupTransport::pending(
    c10::intrusive_ptr<c10d::Work> work, const at::Tensor& flat, const std::string& what) {
  launched_ += 1;
  const auto device = flat.device().type();
  const bool stream_ordered =
      stream_ordered_wait(device, group_->getBackend(device)->getBackendName());
  return std::make_unique<PendingWork>(std::move(work), stream_ordered, what + " over " + name(),
                                       deadlines_);
}

at::Tensor ProcessGroupTransport::shardable(const at::Tensor& flat, const char* op) const {
  const int64_t world = group_->getSize();
  TORCH_CHECK(flat.is_contiguous(), "FusedReducer: the ", op, " over ", name(),
              " needs a contiguous bucket; got one of sizes ", flat.sizes(), " and strides ",
              flat.strides());
  TORCH_CHECK(flat.numel() % world == 0, "FusedReducer: the ", op, " over ", name(),
              " needs a bucket whose number of elements is a multiple of the world size (each of "
              "the ", world, " ranks owns an equal shard); got ", flat.numel(), " elements (",
              flat.numel(), " % ", world, " = ", flat.numel() % world, ")");
  return flat.view({-1});
}

std::unique_ptr<PendingCollective> ProcessGroupTransport::reduce_scatter_sum(
    at::Tensor& flat, const std::string& label) {
  // See Note [Process-group reduce-scatter and all-gather].
  deadlines_->check();
  at::Tensor whole = shardable(flat, "reduce-scatter");
  const std::string what = label.empty() ? "reduce-scatter #" + std::to_string(launched_ + 1)
                                          : "reduce-scatter of " + label;
  const auto device = flat.device().type();
  if (group_->getBackend(device)->getBackendName() == "gloo") {
    std::vector<at::Tensor> tensors{whole};
    c10d::AllreduceOptions options;
    options.reduceOp = c10d::ReduceOp::SUM;
    return pending(group_->allreduce(tensors, options), flat, what);
  }
  const int64_t shard = whole.numel() / group_->getSize();
  at::Tensor mine = whole.narrow(0, group_->getRank() * shard, shard);
  c10d::ReduceScatterOptions options;
  options.reduceOp = c10d::ReduceOp::SUM;
  return pending(group_->reduce_scatter_single(mine, whole, options), flat, what);
}

std::unique_ptr<PendingCollective> ProcessGroupTransport::all_gather(at::Tensor& flat,
                                                                     const std::string& label) {
  deadlines_->check();
  at::Tensor whole = shardable(flat, "all-gather");
  const std::string what =
      label.empty() ? "all-gather #" + std::to_string(launched_ + 1) : "all-gather of " + label;
  const int64_t shard = whole.numel() / group_->getSize();
  at::Tensor mine = whole.narrow(0, group_->getRank() * shard, shard);
  return pending(group_->all_gather_single(whole, mine), flat, what);
}

std::string ProcessGroupTransport::name() const {
  return "process_group(" + group_->getBackendName() + ")";
}

void ProcessGroupTransport::check() { deadlines_->check(); }

}  // namespace fused_reducer
