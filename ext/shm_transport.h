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
  std::string name() const override { return "shm"; }
  void check() override;
  void close(std::chrono::milliseconds deadline) override;

  struct Job;
  struct Runtime;

 private:
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
