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

// Note [Releasing process-group work]
// A c10d Work keeps the thread-local state of its launch (at::ThreadLocalState), and inside
// backward that state holds a Python object (torch stashes a contextvars.Context there while the
// autograd engine runs). The backend's own thread (gloo's pt_gloo_runloop, NCCL's watchdog) keeps
// a reference to the work until a moment after the work completes. If that reference is the
// last, the Python object is released on the backend's thread, which must take the GIL; during
// interpreter shutdown Python ends any thread that asks for the GIL with pthread_exit, and its
// unwinding through the work's noexcept destructor calls std::terminate: "terminate called
// without an active exception", SIGABRT, a job that had finished training fails at exit (issue
// 29; core dump: ~AsyncWork -> ~ThreadLocalState -> decref -> take_gil -> pthread_exit). So
// FusedReducer never lets go of its work while the backend still holds it: release_work()
// drops a work at once when ours is the only reference and otherwise parks it; every later call
// drops the parked works that have become ours alone, and settle_released_works() (close() and
// interpreter exit, before Python finalises) waits a bounded time for the rest. What the
// backend still holds after that (a collective that never completes) is deliberately never
// released: a few bytes leaked at exit instead of an abort. The parking list itself is never
// destroyed, for the same reason (static destructors run after Python has finalised).
void release_work(c10::intrusive_ptr<c10d::Work> work);
// Waits up to `deadline` until every parked work is ours alone and drops it; returns how many
// are still held by their backend (never released).
size_t settle_released_works(std::chrono::milliseconds deadline);

// Whether `backend`'s wait on tensors of `device` only orders the current stream after the
// collective (NCCL on CUDA), rather than blocking the host until it is done.
bool stream_ordered_wait(c10::DeviceType device, const std::string& backend);

// Stream-ordered collectives that were waited on (so the host went on) but may still run on
// the device, each with its deadline. Shared by a transport and its pending collectives.
class WorkDeadlines {
 public:
  using Clock = std::chrono::steady_clock;
  ~WorkDeadlines();  // the works still watched go through release_work()
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

// Note [Naming a dead peer over a process group]
// Gloo reports a peer that died or left as "Connection closed by peer [address]:port", without
// its rank. The ranks of this host tell each other their pids at construction (the store);
// when a collective fails, the error names the ranks among them whose process has exited (or is
// exiting: its sockets close before it is reaped), polling for a short while because the error
// can arrive just before the peer's exit is visible. Ranks on other hosts are not named (gloo's
// address is); the shared-memory transport names its peers itself (Note [Shared-memory all-reduce]).
class PeerProcesses {
 public:
  void set(std::vector<std::pair<int64_t, int64_t>> rank_pids);  // peers on this host
  // "; rank 1 (pid 4242, this host) has exited" for every such peer gone within `patience`, or "".
  std::string gone(std::chrono::milliseconds patience) const;

 private:
  mutable std::mutex mutex_;
  std::vector<std::pair<int64_t, int64_t>> rank_pids_;
};

// One process-group collective in flight (see Note [Process-group work without host stalls]).
class PendingWork : public PendingCollective {
 public:
  PendingWork(c10::intrusive_ptr<c10d::Work> work, bool stream_ordered, std::string what,
              std::shared_ptr<WorkDeadlines> deadlines,
              std::shared_ptr<const PeerProcesses> peers = nullptr);
  ~PendingWork() override { release_work(std::move(work_)); }  // Note [Releasing process-group work]
  bool completed() override { return work_->isCompleted(); }
  void wait(std::chrono::milliseconds timeout) override;

 private:
  void wait_for_work(std::chrono::milliseconds timeout);
  std::shared_ptr<const PeerProcesses> peers_;
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
  // The (rank, pid) of the peers on this host: see Note [Naming a dead peer over a process group].
  void set_peer_processes(std::vector<std::pair<int64_t, int64_t>> rank_pids) {
    peers_->set(std::move(rank_pids));
  }

 private:
  std::unique_ptr<PendingCollective> allreduce(at::Tensor& flat, const std::string& what);
  // The pending object of `work` on `flat`'s device, named `what` (+ " over <name>").
  std::unique_ptr<PendingCollective> pending(c10::intrusive_ptr<c10d::Work> work,
                                             const at::Tensor& flat, const std::string& what);
  // `flat` as a 1-D tensor of world-size equal shards; raises naming the rule otherwise.
  at::Tensor shardable(const at::Tensor& flat, const char* op) const;

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  std::shared_ptr<WorkDeadlines> deadlines_ = std::make_shared<WorkDeadlines>();
  std::shared_ptr<PeerProcesses> peers_ = std::make_shared<PeerProcesses>();
  int64_t launched_ = 0;
};

}  // namespace fused_reducer
