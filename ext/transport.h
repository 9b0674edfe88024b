// Transport: how one flat bucket is summed across ranks.
//
// The reducer (bucketing, ready tracking, copies) is written against this
// interface only; transports differ in how a bucket moves, nothing else.
// ProcessGroupTransport works with any c10d backend (gloo on CPU); the NCCL
// transport calls NCCL directly on the reducer's own streams.
//
// Note [Process life]
// What the extension creates that must end, and how it ends on every path a process takes.
// Resources: (1) the shared-memory transport's worker thread, one per transport; (2) its segment,
// a /dev/shm name and one mapping per rank; (3) the NCCL transport's communicator and (4) its
// watchdog thread; (5) the pinned host buffer of the used map on CUDA (a torch tensor);
// (6) process-group works (torch's threads run them); (7) the gradient hooks on the parameters'
// accumulators. Paths:
//  - close() (also what garbage collection of the model does, and what the exit handler does):
//    (7) removed, the collectives already launched waited for, bounded by the timeout (at most
//    10 s); then (1) finishes the buckets already queued until that deadline (its waits give up
//    after it), is joined, and the segment's stop word is set (peers fail at once, naming this
//    rank); (4) is drained and joined, then (3) destroyed, or aborted at the deadline or on an
//    error; (5) is freed with the reducer; (6) goes through Note [Releasing process-group work].
//    Idempotent; a second caller waits for the first. No transport needs the process group to
//    close, so destroy_process_group() before or after close() changes nothing.
//  - interpreter exit (atexit, after or without destroy_process_group()): fused_reducer's exit
//    handler closes every model still open, then waits (at most 2 s) for the process group's
//    threads to let go of the reducer's works; all before Python finalises. Later teardown finds
//    only closed transports. Nothing of ours has a static destructor that joins or frees a
//    thread's state (the parked works are leaked by design), so static destruction is inert.
//  - the segment's name: removed by rank 0 as soon as every rank has mapped it or given up, so
//    no path, SIGKILL included, leaves it in /dev/shm once construction returned; a rank 0
//    killed during construction leaves it, and the next run's sweep_dead_segments removes it.
//    The mapping ends with the process (munmap in the owner; MADV_DONTFORK keeps children out).
//  - a forked child (a DataLoader worker): (1) and (4) do not exist there and the parent's
//    locks may be held, so every entry point checks the pid; the child abandons (1), (3) and
//    (4) without touching them (destroying a joinable std::thread aborts), never maps (2), and
//    its collectives raise. See Note [Shared-memory transport in a forked child]. (5) is a torch
//    tensor in the child's copy of memory, freed (host memory only) with its reducer; (6): the
//    child has none of the parent's process-group threads, and its copies of the works are
//    parked, never released; (7) are removed with the child's reducer, touching only its copy.
//  - a torchrun restart: the new attempt's processes find the dead attempt's keys in torchrun's
//    store; FusedReducer's keys live in a namespace the new group agrees on (transport.py,
//    attempt_token), and torch's own keys can be removed before init_process_group
//    (python/fused_reducer/transports/elastic.py; scripts/restart_study.py measures restarts
//    with DDP beside).
//  - an exception raised in training (a bad batch, a KeyboardInterrupt in backward): it
//    propagates to the user; the collectives already launched stay with the reducer and are
//    waited for (bounded) by close(), usually the exit handler's. The peers, waiting for this
//    rank's buckets, raise when it closes or exits: shm through the stop word or its pid
//    (Note [Shared-memory all-reduce]), a process group when its connection closes, naming the
//    rank (Note [Naming a dead peer over a process group]).
//  - SIGTERM (torchrun stopping a job) or SIGKILL: no handler of ours; the process ends at once
//    and no destructor runs. The kernel unmaps (2) and closes sockets; peers raise as above.
// scripts/lifecycle_stress.py runs these endings many times (docs/TESTING.md, "Process life").
#pragma once

#include <ATen/ATen.h>

#include <chrono>
#include <memory>
#include <string>

namespace fused_reducer {

// A collective in flight.
class PendingCollective {
 public:
  virtual ~PendingCollective() = default;
  // Blocks until the result may be read on the caller's stream. Throws on
  // failure or after `timeout`; the caller adds which bucket it was.
  virtual void wait(std::chrono::milliseconds timeout) = 0;
  // True when wait() would return at once (polled during backward to unpack
  // early); transports that cannot tell say false.
  virtual bool completed() { return false; }
};

class Transport {
 public:
  virtual ~Transport() = default;
  // Starts an in-place sum all-reduce of `flat` (a contiguous buffer owned by
  // the reducer, kept alive by it until wait() returns).
  virtual std::unique_ptr<PendingCollective> allreduce_sum(at::Tensor& flat) = 0;
  // The same, with a name for the collective, e.g. "bucket 3 of 7 (12 parameters, 4 MiB,
  // first 'fc.weight')", for errors a transport raises later and elsewhere than in this
  // collective's wait() (the NCCL watchdog's, raised by whichever call comes next, so the caller
  // cannot add the name itself). Transports that fail only inside wait() ignore it.
  virtual std::unique_ptr<PendingCollective> allreduce_sum_labeled(at::Tensor& flat,
                                                                   const std::string& label) {
    (void)label;
    return allreduce_sum(flat);
  }
  // Sharded mode (ShardedOptimizer): `flat` has a multiple of world_size elements and rank r
  // owns the r-th of world_size equal shards of it. Starts an in-place sum reduce-scatter: when
  // wait() returns, this rank's shard of `flat` holds the sum of every rank's shard r (the other
  // shards are unspecified). The sum is the same, element for element, as allreduce_sum's.
  virtual std::unique_ptr<PendingCollective> reduce_scatter_sum(at::Tensor& flat,
                                                                const std::string& label) {
    (void)flat;
    (void)label;
    TORCH_CHECK(false, "FusedReducer: the ", name(), " transport has no reduce-scatter");
  }
  // Starts an in-place all-gather: when wait() returns, every shard of `flat` holds its owner's
  // shard (each rank contributes its own shard of `flat`).
  virtual std::unique_ptr<PendingCollective> all_gather(at::Tensor& flat, const std::string& label) {
    (void)flat;
    (void)label;
    TORCH_CHECK(false, "FusedReducer: the ", name(), " transport has no all-gather");
  }
  // Short name for stats and error messages, e.g. "process_group(gloo)".
  virtual std::string name() const = 0;
  // Raises the error of a collective that failed in the background (the NCCL
  // watchdog), if any.
  virtual void check() {}
  // Releases the communicator: in-flight work gets until `deadline`, then it
  // is aborted. Idempotent; nothing may be launched afterwards.
  virtual void close(std::chrono::milliseconds deadline) { (void)deadline; }
};

}  // namespace fused_reducer
