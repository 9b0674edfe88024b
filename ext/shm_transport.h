// Shared-memory transport: every rank of the group on one host, CPU buckets.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "shm_segment.h"
#include "transport.h"

namespace fused_reducer {

// Note [Shared-memory all-reduce]
// Gloo sums CPU tensors over TCP, also between two processes of one host: every
// byte crosses the loopback socket stack twice per rank, which on a CPU host is
// most of a step's communication cost. When all ranks share a host, the ranks
// map one segment (/dev/shm) and sum through it instead, chunk by chunk:
//   1. each rank copies its chunk of the bucket into its own input slot;
//   2. once all inputs are in, rank r sums its 1/world of the chunk over the
//      input slots, in rank order, into the shared result slot;
//   3. once all parts are summed, each rank copies the whole result back.
// Every rank reads the same summed bytes, so replicas stay bit-identical.
// Two sets of slots alternate between consecutive chunks; that makes two
// arrivals per chunk enough (a rank that has arrived for chunk k has finished
// reading chunk k-2's slots). One worker thread per rank runs the buckets in
// the order they were started (the order every transport requires). Waits
// sleep on a futex; they fail, never hang, when a peer process exits, closes
// or fails (the segment's stop word), or after the timeout. The segment and
// this protocol are torch-free (shm_segment.h); see Note [Shared-memory segment
// trust] for what is read from the shared header and what never is.
//
// Note [Shared-memory reduce-scatter and all-gather]
// The sharded mode's collectives (Transport::reduce_scatter_sum, all_gather) are the all-reduce's
// two halves, run chunk by chunk through the same slots, worker and job machinery, on a bucket of
// world_size equal shards (rank r owns the r-th):
//   reduce-scatter: steps 1 and 2 as above (every rank copies its whole chunk in, and the ranks
//     sum it with the same code, over the same parts, in the same rank order, so every element is
//     bit-identical to the all-reduce's); in step 3 each rank copies back only the part of the
//     result that lies in its own shard;
//   all-gather: each rank copies only its own shard's part of the chunk, straight into the
//     result slot (the ranks' parts are disjoint and cover it); once all are in, every rank copies
//     the whole result out. Nothing is summed: any dtype.
// Every collective arrives once its chunk's inputs are in and waits for all the ranks there, so
// the invariant of two slot sets above holds across collectives of any kind in any order. The
// size check of a bucket's first chunk compares the kind of collective too: a rank that starts a
// reduce-scatter while another starts an all-reduce or an all-gather (a rank whose model switched
// to sharded mode and another's that did not) raises on every rank, naming both, instead of
// mixing their data. The all-gather, which has no sums to wait for, waits once more after the
// check of its first chunk, so that no peer publishes its next bucket's size before every rank
// has compared this one's. Timeouts, dead peers, close() and cancellation are the all-reduce's
// (below): the same waits and the same job lock around every copy into or out of the bucket.
//
// Note [Shared-memory jobs and their buckets]
// A job never owns its bucket's tensor: the PendingCollective does (it is
// released on the caller's thread, which holds the GIL when the caller is
// Python; the worker releasing the last reference of a Python tensor needed the
// GIL and deadlocked a destructor that held it). The worker touches the bucket
// only under the job's lock and only while the job is not cancelled; a wait that
// times out (or a PendingCollective dropped unwaited) cancels the job under that
// lock, so nothing is written into a bucket after its wait returned, and the
// worker then stops the segment: the peers fail that all-reduce too instead of
// taking it for a success.
//
// Note [Shared-memory transport in a forked child]
// A forked child (a DataLoader worker) inherits the transport object but not
// the worker thread, and any of the parent's mutexes may have been held at fork
// time. So everything with a thread or a lock (the runtime) lives on the heap;
// in a child every entry point checks the pid first and touches no lock: the
// destructor abandons the runtime (destroying a joinable std::thread aborts, and
// ~condition_variable waits for the parent's waiters forever), waits and
// all-reduces raise, close() returns. The segment is not mapped in the child at
// all (MADV_DONTFORK).
class ShmTransport : public Transport {
 public:
  // Creates (`create`, one rank) or maps the segment `name` (a POSIX shm name,
  // "/..."), with slots of `chunk_bytes`. Throws if it cannot, naming why.
  ShmTransport(const std::string& name, bool create, int rank, int world_size,
               int64_t chunk_bytes, std::chrono::milliseconds timeout);
  ~ShmTransport() override;

  // Removes the segment's name (every rank has mapped it by then): nothing is
  // left in /dev/shm even if a process is killed later.
  void unlink();
  // Once every rank has mapped the segment: liveness of peers is checked
  // through their pids when they are all in this pid namespace.
  void start_peer_checks();
  bool watches_peers() const { return check_peers_; }

  std::unique_ptr<PendingCollective> allreduce_sum(at::Tensor& flat) override;
  // See Note [Shared-memory reduce-scatter and all-gather].
  std::unique_ptr<PendingCollective> reduce_scatter_sum(at::Tensor& flat,
                                                        const std::string& label) override;
  std::unique_ptr<PendingCollective> all_gather(at::Tensor& flat,
                                                const std::string& label) override;
  std::string name() const override { return "shm"; }
  void check() override;
  void close(std::chrono::milliseconds deadline) override;

  struct Job;
  struct Runtime;

 private:
  std::unique_ptr<PendingCollective> start(at::Tensor& flat, shm::Collective op);
  void run_worker();
  void reduce(Job& job);
  void fail(const std::string& error);
  bool in_forked_child() const;

  int rank_;
  int world_;
  std::chrono::milliseconds timeout_;
  std::unique_ptr<shm::Segment> segment_;
  bool check_peers_ = false;
  pid_t owner_pid_ = 0;  // the process that made this transport (not a forked child)
  uint64_t chunks_done_ = 0;  // chunks summed so far: same count on every rank
  Runtime* runtime_ = nullptr;  // See Note [Shared-memory transport in a forked child]
};

}  // namespace fused_reducer
