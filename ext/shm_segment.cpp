#include "shm_segment.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <new>
#include <thread>

namespace fused_reducer::shm {

static_assert(offsetof(Header, magic) == 0 && offsetof(Header, world) == 8 &&
                  offsetof(Header, chunk_bytes) == 16,
              "tests/test_shm_transport.py rewrites these fields by offset");
static_assert(sizeof(RankState) == 64);

namespace {

constexpr size_t kPage = 4096;
constexpr auto kSleepSlice = std::chrono::milliseconds(20);
constexpr auto kPeerCheckEvery = std::chrono::milliseconds(100);

std::string os_error(const std::string& what, int err = errno) {
  return what + ": " + std::strerror(err);
}

long futex(std::atomic<uint32_t>* word, int op, uint32_t value, const timespec* timeout) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, timeout, nullptr, 0);
}

// "/proc/<pid>/stat" fields after the command name: {state, ppid, ..., starttime at 19}.
bool read_stat(pid_t pid, char* state, uint64_t* start_time) {
  const std::string path = "/proc/" + std::to_string(pid) + "/stat";
  FILE* file = std::fopen(path.c_str(), "r");
  if (file == nullptr) return false;
  char line[1024];
  const size_t n = std::fread(line, 1, sizeof(line) - 1, file);
  std::fclose(file);
  line[n] = '\0';
  const char* rest = std::strrchr(line, ')');  // "pid (comm) S ..."; comm may hold ')'
  if (rest == nullptr || rest[1] == '\0') return false;
  *state = rest[2];
  const char* field = rest + 2;
  for (int i = 0; i < 19 && field != nullptr; ++i) {
    field = std::strchr(field, ' ');
    if (field != nullptr) ++field;
  }
  *start_time = field != nullptr ? std::strtoull(field, nullptr, 10) : 0;
  return true;
}

}  // namespace

std::chrono::milliseconds timeout_from_seconds(double seconds) {
  if (std::isnan(seconds) || seconds <= 0) return std::chrono::milliseconds(0);
  const double ms = seconds * 1000.0;
  if (!(ms < static_cast<double>(kLongestTimeout.count()))) return kLongestTimeout;
  return std::chrono::milliseconds(static_cast<int64_t>(ms));
}

std::chrono::milliseconds clamp_timeout(std::chrono::milliseconds timeout) {
  return std::clamp(timeout, std::chrono::milliseconds(0), kLongestTimeout);
}

uint64_t process_start_time(pid_t pid) {
  char state = 0;
  uint64_t start = 0;
  return read_stat(pid, &state, &start) ? start : 0;
}

uint64_t pid_namespace_id() {
  struct stat info {};
  return stat("/proc/self/ns/pid", &info) == 0 ? static_cast<uint64_t>(info.st_ino) : 0;
}

bool process_alive(pid_t pid, uint64_t start_time) {
  if (pid <= 0) return true;  // not registered: nothing to check
  if (kill(pid, 0) != 0 && errno == ESRCH) return false;
  char state = 0;
  uint64_t start = 0;
  if (!read_stat(pid, &state, &start)) return true;  // no /proc: trust kill()
  if (state == 'Z' || state == 'X') return false;    // exited, not yet reaped
  return start_time == 0 || start == 0 || start == start_time;
}

Layout Layout::make(int world, int64_t chunk_bytes) {
  if (world < 1 || world > kMaxWorld) {
    throw Error("world size " + std::to_string(world) + " is outside 1.." +
                std::to_string(kMaxWorld));
  }
  if (chunk_bytes < kMinChunkBytes || chunk_bytes > kMaxChunkBytes || chunk_bytes % 64 != 0) {
    throw Error("chunk_bytes must be a multiple of 64 in " + std::to_string(kMinChunkBytes) +
                ".." + std::to_string(kMaxChunkBytes) + "; got " + std::to_string(chunk_bytes));
  }
  Layout layout;
  layout.world = world;
  layout.chunk_bytes = chunk_bytes;
  layout.data_offset = (sizeof(Header) + kPage - 1) / kPage * kPage;
  // Bounded above (2 * 65 * 2^30 + a few pages), checked anyway: no size here can wrap.
  size_t slots = 0;
  size_t data = 0;
  if (__builtin_mul_overflow(size_t(2), static_cast<size_t>(world + 1), &slots) ||
      __builtin_mul_overflow(slots, static_cast<size_t>(chunk_bytes), &data) ||
      __builtin_add_overflow(layout.data_offset, data, &layout.total_bytes) ||
      layout.total_bytes > static_cast<size_t>(INT64_MAX)) {
    throw Error("segment size overflows");
  }
  return layout;
}

Segment::Segment(std::string name, Layout layout, char* base)
    : name_(std::move(name)), layout_(layout), base_(base),
      header_(reinterpret_cast<Header*>(base)), mapped_by_(getpid()) {
  // A forked child (a DataLoader worker) gets no copy of the mapping: it can
  // neither scribble on the peers' slots nor keep the pages alive.
  madvise(base_, layout_.total_bytes, MADV_DONTFORK);
}

Segment::~Segment() {
  if (getpid() == mapped_by_) munmap(base_, layout_.total_bytes);
}

std::unique_ptr<Segment> Segment::create(const std::string& name, int world,
                                         int64_t chunk_bytes) {
  const Layout layout = Layout::make(world, chunk_bytes);
  const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) throw Error(os_error("cannot create shared memory " + name));
  auto fail = [&](const std::string& what, int err) {
    ::close(fd);
    shm_unlink(name.c_str());
    throw Error(os_error(what, err));
  };
  if (fchmod(fd, 0600) != 0) fail("cannot set the mode of shared memory " + name, errno);  // umask
  // Reserve the pages now: an exhausted /dev/shm fails here, not with SIGBUS mid-step.
  const int err = posix_fallocate(fd, 0, static_cast<off_t>(layout.total_bytes));
  if (err != 0) {
    fail("cannot reserve " + std::to_string(layout.total_bytes >> 10) +
             " KiB of shared memory in /dev/shm", err);
  }
  void* base = mmap(nullptr, layout.total_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) fail("cannot map shared memory " + name, errno);
  ::close(fd);
  auto* header = new (base) Header();
  header->world = world;
  header->chunk_bytes = chunk_bytes;
  header->magic = kMagic;  // peers learn the name only later, through the store
  return std::unique_ptr<Segment>(new Segment(name, layout, static_cast<char*>(base)));
}

std::unique_ptr<Segment> Segment::attach(const std::string& name, int world,
                                         int64_t chunk_bytes) {
  const Layout layout = Layout::make(world, chunk_bytes);
  const int fd = shm_open(name.c_str(), O_RDWR | O_NOFOLLOW, 0);
  if (fd < 0) throw Error(os_error("cannot open shared memory " + name));
  struct stat info {};
  std::string wrong;
  if (fstat(fd, &info) != 0) {
    wrong = os_error("cannot stat it");
  } else if (!S_ISREG(info.st_mode)) {
    wrong = "it is not a regular file";
  } else if (info.st_uid != geteuid()) {
    wrong = "it belongs to uid " + std::to_string(info.st_uid) + ", not to this process's uid " +
            std::to_string(geteuid());
  } else if ((info.st_mode & 07777) != 0600) {
    char mode[8];
    std::snprintf(mode, sizeof(mode), "%04o", static_cast<unsigned>(info.st_mode & 07777));
    wrong = std::string("its mode is ") + mode + ", not 0600";
  } else if (static_cast<uint64_t>(info.st_size) != layout.total_bytes) {
    wrong = "its size is " + std::to_string(info.st_size) + " bytes, not the " +
            std::to_string(layout.total_bytes) + " this rank expects";
  }
  if (!wrong.empty()) {
    ::close(fd);
    throw Error("refusing shared memory " + name + ": " + wrong +
                " (another process made or changed it)");
  }
  void* base = mmap(nullptr, layout.total_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int map_errno = errno;
  ::close(fd);
  if (base == MAP_FAILED) throw Error(os_error("cannot map shared memory " + name, map_errno));
  std::unique_ptr<Segment> segment(new Segment(name, layout, static_cast<char*>(base)));
  const Header& header = segment->header();
  if (header.magic != kMagic || header.world != world || header.chunk_bytes != chunk_bytes) {
    throw Error("shared memory " + name + " was made for another world size or chunk size (or "
                "by another version of fused_reducer)");
  }
  return segment;
}

void Segment::unlink() { shm_unlink(name_.c_str()); }

void Segment::register_rank(int rank) {
  RankState& me = header_->ranks[rank];
  const pid_t pid = getpid();
  me.start_time.store(process_start_time(pid));
  me.pid_namespace.store(pid_namespace_id());
  me.pid.store(pid);
}

bool Segment::peers_watchable() const {
  const uint64_t mine = pid_namespace_id();
  if (mine == 0) return false;
  for (int r = 0; r < layout_.world; ++r) {
    const RankState& peer = header_->ranks[r];
    if (peer.pid.load() <= 0 || peer.pid_namespace.load() != mine) return false;
  }
  return true;
}

void Segment::arrive(int rank, uint64_t arrival) {
  header_->ranks[rank].arrived.store(arrival);
  header_->wake.fetch_add(1);
  if (header_->sleepers.load() > 0) {
    futex(&header_->wake, FUTEX_WAKE, INT_MAX, nullptr);
  }
}

void Segment::stop(int rank) {
  int32_t none = 0;
  header_->stopped.compare_exchange_strong(none, rank + 1);
  header_->wake.fetch_add(1);
  futex(&header_->wake, FUTEX_WAKE, INT_MAX, nullptr);
}

void Segment::wait_for_all(uint64_t arrival, const char* phase, const WaitLimits& limits) {
  const auto timeout = clamp_timeout(limits.timeout);
  const auto start = std::chrono::steady_clock::now();
  auto last_peer_check = start;
  for (int round = 0;; ++round) {
    const uint32_t seen = header_->wake.load();
    int missing = -1;
    for (int r = 0; r < layout_.world && missing < 0; ++r) {
      if (header_->ranks[r].arrived.load() < arrival) missing = r;
    }
    if (limits.waiting_for != nullptr) limits.waiting_for->store(missing);
    if (missing < 0) return;
    if (limits.cancelled != nullptr && limits.cancelled->load()) {
      throw Cancelled(std::string("the bucket's wait gave up while this rank waited for rank ") +
                      std::to_string(missing) + " (" + phase + ")");
    }
    const int32_t stopped = header_->stopped.load();
    if (stopped != 0) {
      throw Error("rank " + std::to_string(stopped - 1) +
                  " stopped reducing (it failed, timed out, closed its FusedReducer or is "
                  "exiting) while this rank waited for it (" + phase + ")");
    }
    if (round < 64) {  // a peer usually arrives within microseconds: spin briefly first
      std::this_thread::yield();
      continue;
    }
    const auto now = std::chrono::steady_clock::now();
    if (limits.abort_after_ns != nullptr &&
        now.time_since_epoch().count() > limits.abort_after_ns->load()) {
      throw Error(std::string("closed while waiting for rank ") + std::to_string(missing) +
                  " (" + phase + ")");
    }
    if (now - start > timeout) {
      throw Error("timed out after " + std::to_string(timeout.count()) +
                  " ms waiting for rank " + std::to_string(missing) + " (" + phase +
                  "); it may be stuck, or running other collectives in another order");
    }
    if (limits.check_peers && now - last_peer_check > kPeerCheckEvery) {
      last_peer_check = now;
      const RankState& peer = header_->ranks[missing];
      const auto pid = static_cast<pid_t>(peer.pid.load());
      if (!process_alive(pid, peer.start_time.load())) {
        throw Error("rank " + std::to_string(missing) + " (pid " + std::to_string(pid) +
                    ") exited while this rank waited for it (" + phase + ")");
      }
    }
    timespec slice{0, std::chrono::duration_cast<std::chrono::nanoseconds>(kSleepSlice).count()};
    header_->sleepers.fetch_add(1);
    futex(&header_->wake, FUTEX_WAIT, seen, &slice);
    header_->sleepers.fetch_sub(1);
  }
}

std::string collective_name(int32_t code) {
  switch (code) {
    case static_cast<int32_t>(Collective::kAllReduce): return "all-reduce";
    case static_cast<int32_t>(Collective::kReduceScatter): return "reduce-scatter";
    case static_cast<int32_t>(Collective::kAllGather): return "all-gather";
    default: return "an unknown collective (" + std::to_string(code) + ")";
  }
}

namespace {

// What the ranks' mismatched buckets are called in the error: "reduce different buckets".
std::string verb(int32_t op) {
  switch (op) {
    case static_cast<int32_t>(Collective::kReduceScatter): return "reduce-scatter";
    case static_cast<int32_t>(Collective::kAllGather): return "all-gather";
    default: return "reduce";
  }
}

// "an all-reduce", "a reduce-scatter", ...
std::string with_article(int32_t op) {
  const std::string name = collective_name(op);
  if (name.rfind("an ", 0) == 0) return name;
  return (name[0] == 'a' ? "an " : "a ") + name;
}

// Raises on every rank when any rank runs another collective, or the same one on another bucket.
void check_same_bucket(Segment& segment, int rank, int32_t op, const BucketIo& bucket) {
  for (int r = 0; r < segment.layout().world; ++r) {
    const RankState& peer = segment.header().ranks[r];
    const int64_t peer_numel = peer.numel.load();
    const int32_t peer_dtype = peer.dtype.load();
    const int32_t peer_op = peer.op.load();
    if (peer_op != op) {
      throw Error("ranks run different collectives: this rank (" + std::to_string(rank) +
                  ") runs " + with_article(op) + " of " +
                  std::to_string(bucket.check_numel) + " elements of " +
                  bucket.dtype_name(bucket.check_dtype) + ", rank " + std::to_string(r) +
                  " " + with_article(peer_op) + " of " + std::to_string(peer_numel) +
                  " elements of " + bucket.dtype_name(peer_dtype) +
                  "; every rank must start the same collectives in the same order");
    }
    if (peer_numel != bucket.check_numel || peer_dtype != bucket.check_dtype) {
      throw Error("ranks " + verb(op) + " different buckets: this rank (" +
                  std::to_string(rank) + ") has " + std::to_string(bucket.check_numel) +
                  " elements of " + bucket.dtype_name(bucket.check_dtype) + ", rank " +
                  std::to_string(r) + " has " + std::to_string(peer_numel) + " elements of " +
                  bucket.dtype_name(peer_dtype) +
                  "; the models (or their bucket settings) differ across ranks");
    }
  }
}

}  // namespace

void reduce(Segment& segment, int rank, const BucketIo& bucket, uint64_t& chunks_done,
            const WaitLimits& limits) {
  run(segment, rank, Collective::kAllReduce, bucket, chunks_done, limits);
}

void reduce_scatter(Segment& segment, int rank, const BucketIo& bucket, uint64_t& chunks_done,
                    const WaitLimits& limits) {
  run(segment, rank, Collective::kReduceScatter, bucket, chunks_done, limits);
}

void all_gather(Segment& segment, int rank, const BucketIo& bucket, uint64_t& chunks_done,
                const WaitLimits& limits) {
  run(segment, rank, Collective::kAllGather, bucket, chunks_done, limits);
}

// Note [Shared-memory reduce-scatter and all-gather] (shm_transport.h) on top of the all-reduce's
// chunk loop: every collective arrives at 2k+1 once its inputs of chunk k are in and waits for
// every rank there (the size check of the first chunk follows that wait), so "a rank that has
// arrived for chunk k has finished reading chunk k-2's slots" holds across collectives of any
// kind. The all-reduce and the reduce-scatter then sum and arrive at 2k+2; the all-gather has
// nothing to sum and arrives at 2k+2 only on its first chunk (see there why).
void run(Segment& segment, int rank, Collective op, const BucketIo& bucket, uint64_t& chunks_done,
         const WaitLimits& limits) {
  const Layout& layout = segment.layout();
  const int world = layout.world;
  const int64_t numel = bucket.numel;
  const int64_t element = bucket.element_bytes;
  if (element <= 0 || element > 64 || layout.chunk_bytes % element != 0 || numel < 0) {
    throw Error("element size " + std::to_string(element) + " or count " +
                std::to_string(numel) + " out of range");
  }
  const auto code = static_cast<int32_t>(op);
  if (op != Collective::kAllReduce && op != Collective::kReduceScatter &&
      op != Collective::kAllGather) {
    throw Error(collective_name(code) + " is not a shared-memory collective");
  }
  const bool sharded = op != Collective::kAllReduce;
  if (sharded && numel % world != 0) {
    throw Error("a " + collective_name(code) + " needs a bucket whose number of elements is a "
                "multiple of the world size (each of the " + std::to_string(world) +
                " ranks owns an equal shard); got " + std::to_string(numel) + " elements");
  }
  // This rank's shard, [shard_lo, shard_hi) of the bucket.
  const int64_t shard_lo = sharded ? rank * (numel / world) : 0;
  const int64_t shard_hi = sharded ? shard_lo + numel / world : numel;
  RankState& me = segment.header().ranks[rank];
  me.numel.store(bucket.check_numel);
  me.dtype.store(bucket.check_dtype);
  me.op.store(code);
  const int64_t chunk_elements = layout.chunk_bytes / element;
  std::vector<const char*> inputs(world);
  for (int64_t start = 0; start == 0 || start < numel; start += chunk_elements) {
    const int64_t len = std::min(chunk_elements, numel - start);
    const int set = static_cast<int>(chunks_done % 2);
    const uint64_t copied_in = 2 * chunks_done + 1;
    char* result = segment.slot(set, world);
    // The part of this chunk in this rank's shard: [mine_lo, mine_hi) of the bucket.
    const int64_t mine_lo = std::max(start, shard_lo);
    const int64_t mine_hi = std::min(start + len, shard_hi);
    if (op == Collective::kAllGather) {
      // Straight into the result slot: the ranks' parts are disjoint and cover the chunk.
      if (mine_hi > mine_lo) {
        bucket.copy_in(result + (mine_lo - start) * element, mine_lo, mine_hi - mine_lo);
      }
    } else if (len > 0) {
      bucket.copy_in(segment.slot(set, rank), start, len);
    }
    segment.arrive(rank, copied_in);
    segment.wait_for_all(copied_in, "inputs", limits);
    if (start == 0) check_same_bucket(segment, rank, code, bucket);
    if (op == Collective::kAllGather) {
      if (len > 0) bucket.copy_out(result, start, len);
      if (start == 0) {
        // A peer that finished this (one-chunk) all-gather would otherwise publish its next
        // bucket's size and kind while this rank still compares them for this one.
        segment.arrive(rank, copied_in + 1);
        segment.wait_for_all(copied_in + 1, "the size check", limits);
      }
      ++chunks_done;
      if (numel == 0) break;
      continue;
    }
    // This rank's part of the chunk, cache-line aligned.
    const int64_t per_line = std::max<int64_t>(1, 64 / element);
    const int64_t part = (len + world * per_line - 1) / (world * per_line) * per_line;
    const int64_t lo = std::min(len, rank * part);
    const int64_t hi = std::min(len, lo + part);
    if (hi > lo) {
      for (int r = 0; r < world; ++r) inputs[r] = segment.slot(set, r) + lo * element;
      bucket.sum(result + lo * element, inputs, hi - lo);
    }
    // A cancelled bucket does not arrive: the peers must not finish a sum this rank refused.
    if (limits.cancelled != nullptr && limits.cancelled->load()) {
      throw Cancelled("the bucket's wait gave up before this rank's part was summed");
    }
    segment.arrive(rank, copied_in + 1);
    segment.wait_for_all(copied_in + 1, "sums", limits);
    if (op == Collective::kAllReduce) {
      if (len > 0) bucket.copy_out(result, start, len);
    } else if (mine_hi > mine_lo) {
      bucket.copy_out(result + (mine_lo - start) * element, mine_lo, mine_hi - mine_lo);
    }
    ++chunks_done;
    if (numel == 0) break;
  }
}

}  // namespace fused_reducer::shm
