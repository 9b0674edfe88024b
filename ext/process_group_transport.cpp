#include "process_group_transport.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <fstream>
#include <thread>

#include "transport_registry.h"
namespace fused_reducer {

namespace {

// torch 2.12 renamed ProcessGroup::_reduce_scatter_base/_allgather_base to *_single (the old
// names stay as deprecated aliases); GPU machines may carry an older torch, so use whichever the
// headers have. Templates, so that the branch not taken is never compiled.
template <typename Group>
c10::intrusive_ptr<c10d::Work> reduce_scatter_into(Group& group, at::Tensor& out, at::Tensor& in,
                                                   const c10d::ReduceScatterOptions& options) {
  if constexpr (requires { group.reduce_scatter_single(out, in, options); }) {
    return group.reduce_scatter_single(out, in, options);
  } else {
    return group._reduce_scatter_base(out, in, options);
  }
}

template <typename Group>
c10::intrusive_ptr<c10d::Work> all_gather_into(Group& group, at::Tensor& out, at::Tensor& in) {
  if constexpr (requires { group.all_gather_single(out, in); }) {
    return group.all_gather_single(out, in);
  } else {
    return group._allgather_base(out, in);
  }
}

// See Note [Releasing process-group work]. On the heap and never destroyed.
std::mutex& parked_mutex() {
  static auto* mutex = new std::mutex();
  return *mutex;
}

std::vector<c10::intrusive_ptr<c10d::Work>>& parked_works() {
  static auto* parked = new std::vector<c10::intrusive_ptr<c10d::Work>>();
  return *parked;
}

// Drops the parked works that are ours alone (under parked_mutex()); returns how many remain.
size_t drop_settled_locked() {
  auto& parked = parked_works();
  parked.erase(std::remove_if(parked.begin(), parked.end(),
                              [](const c10::intrusive_ptr<c10d::Work>& w) {
                                return w.use_count() == 1;
                              }),
               parked.end());
  return parked.size();
}

}  // namespace

void release_work(c10::intrusive_ptr<c10d::Work> work) {
  std::lock_guard<std::mutex> lock(parked_mutex());
  if (work && work.use_count() > 1) {
    parked_works().push_back(std::move(work));
  }
  drop_settled_locked();
  // `work`, if still ours, is dropped here, on this thread (never the backend's).
}

size_t settle_released_works(std::chrono::milliseconds deadline) {
  const auto until = std::chrono::steady_clock::now() + deadline;
  while (true) {
    {
      std::lock_guard<std::mutex> lock(parked_mutex());
      const size_t held = drop_settled_locked();
      if (held == 0 || std::chrono::steady_clock::now() >= until) {
        return held;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

bool stream_ordered_wait(c10::DeviceType device, const std::string& backend) {
  // Other backends on CUDA tensors (gloo) block the host in wait(); so may unknown ones: they
  // keep wait(timeout), which is correct, if slower.
  return device == c10::DeviceType::CUDA && backend == "nccl";
}

WorkDeadlines::~WorkDeadlines() {
  for (auto& watched : watched_) release_work(std::move(watched.work));
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
      release_work(std::move(it->work));
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

void PeerProcesses::set(std::vector<std::pair<int64_t, int64_t>> rank_pids) {
  std::lock_guard<std::mutex> lock(mutex_);
  rank_pids_ = std::move(rank_pids);
}

namespace {

// Exited or exiting: no such process, a zombie, or dead ('X').
bool process_gone(pid_t pid) {
  if (kill(pid, 0) != 0) return errno == ESRCH;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return false;
  const auto paren = line.rfind(')');
  return paren != std::string::npos && paren + 2 < line.size() &&
         (line[paren + 2] == 'Z' || line[paren + 2] == 'X');
}

}  // namespace

std::string PeerProcesses::gone(std::chrono::milliseconds patience) const {
  std::vector<std::pair<int64_t, int64_t>> peers;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    peers = rank_pids_;
  }
  if (peers.empty()) return "";
  const auto until = std::chrono::steady_clock::now() + patience;
  while (true) {
    std::string named;
    for (const auto& [rank, pid] : peers) {
      if (process_gone(static_cast<pid_t>(pid))) {
        named += "; rank " + std::to_string(rank) + " (pid " + std::to_string(pid) +
                 ", this host) has exited";
      }
    }
    if (!named.empty() || std::chrono::steady_clock::now() >= until) return named;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

PendingWork::PendingWork(c10::intrusive_ptr<c10d::Work> work, bool stream_ordered,
                         std::string what, std::shared_ptr<WorkDeadlines> deadlines,
                         std::shared_ptr<const PeerProcesses> peers)
    : peers_(std::move(peers)),
      work_(std::move(work)),
      stream_ordered_(stream_ordered),
      what_(std::move(what)),
      deadlines_(std::move(deadlines)) {}

void PendingWork::wait(std::chrono::milliseconds timeout) {
  try {
    wait_for_work(timeout);
  } catch (const std::exception& e) {
    // See Note [Naming a dead peer over a process group].
    const std::string gone = peers_ ? peers_->gone(std::chrono::milliseconds(2000)) : "";
    if (gone.empty()) throw;
    throw std::runtime_error(std::string(e.what()) + gone);
  }
}

void PendingWork::wait_for_work(std::chrono::milliseconds timeout) {
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
                                       deadlines_, peers_);
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
  return pending(reduce_scatter_into(*group_, mine, whole, options), flat, what);
}

std::unique_ptr<PendingCollective> ProcessGroupTransport::all_gather(at::Tensor& flat,
                                                                     const std::string& label) {
  deadlines_->check();
  at::Tensor whole = shardable(flat, "all-gather");
  const std::string what =
      label.empty() ? "all-gather #" + std::to_string(launched_ + 1) : "all-gather of " + label;
  const int64_t shard = whole.numel() / group_->getSize();
  at::Tensor mine = whole.narrow(0, group_->getRank() * shard, shard);
  return pending(all_gather_into(*group_, whole, mine), flat, what);
}

std::string ProcessGroupTransport::name() const {
  return "process_group(" + group_->getBackendName() + ")";
}

void ProcessGroupTransport::check() { deadlines_->check(); }

// Made by transports/transport.py's process_group_transport, on any torch.distributed group.
FUSED_REDUCER_REGISTER_TRANSPORT("process_group", [](const TransportArgs& args) {
  return std::make_shared<ProcessGroupTransport>(args.group);
});

}  // namespace fused_reducer
