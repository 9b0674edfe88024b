// Shared-memory transport: every rank of the group on one host, CPU buckets.
#pragma once

#include <atomic>
#include <cstdint>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

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
// or fails (the segment's abort word), or after the timeout.
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
  // Each rank's process id, once every rank has mapped the segment; liveness
  // of peers is checked through them.
  void start_peer_checks();

  std::unique_ptr<PendingCollective> allreduce_sum(at::Tensor& flat) override;
  std::string name() const override { return "shm"; }
  void check() override;
  void close(std::chrono::milliseconds deadline) override;

  struct Job;
  struct Segment;

 private:
  void run_worker();
  void reduce(at::Tensor& flat);
  void wait_for_all(uint64_t arrival, const char* phase);
  void arrive(uint64_t arrival);
  void fail(const std::string& error);
  void stop_peers();  // marks the segment stopped by this rank and wakes the peers

  std::string shm_name_;
  int rank_;
  int world_;
  int64_t chunk_bytes_;
  std::chrono::milliseconds timeout_;
  Segment* segment_ = nullptr;
  size_t mapped_bytes_ = 0;
  bool check_peers_ = false;
  int owner_pid_ = 0;  // the process that made this transport (not a forked child)
  uint64_t chunks_done_ = 0;  // chunks summed so far: same count on every rank

  std::mutex mutex_;
  std::condition_variable queued_;
  std::deque<std::shared_ptr<Job>> queue_;
  bool stopping_ = false;
  // close(): waits give up after this steady_clock time (ns since its epoch).
  std::atomic<int64_t> abort_after_{INT64_MAX};
  std::string error_;  // first failure; every later bucket fails with it
  std::thread worker_;
};

}  // namespace fused_reducer
