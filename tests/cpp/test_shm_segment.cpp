// C++ tests of the torch-free shared-memory segment and its all-reduce protocol
// (ext/shm_segment.h): ranks as threads (one mapping, so ThreadSanitizer sees
// every access; or one mapping each) and as forked processes, sizes across
// chunk edges at 2-8 ranks, the attach checks, a header rewritten after attach,
// timeouts, stops, cancellation, dead and reused peer pids, integer overflow.
// CMake builds it plain, with -fsanitize=thread and with
// -fsanitize=address,undefined; ctest runs all three.
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "shm_segment.h"

namespace shm = fused_reducer::shm;

static int failures = 0;

static void expect(bool ok, const std::string& what) {
  if (!ok) {
    std::cerr << "FAILED: " << what << "\n";
    ++failures;
  }
}

static std::string unique_name(const char* tag) {
  static std::atomic<int> counter{0};
  return "/fused_reducer_cpptest_" + std::to_string(getpid()) + "_" + tag + "_" +
         std::to_string(counter++);
}

// Throws, returning the message; "" when nothing was thrown.
template <typename F>
static std::string error_of(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

static bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

template <typename T>
static std::vector<T> rank_input(int rank, int64_t n) {
  std::mt19937 gen(1000 * rank + static_cast<unsigned>(n));
  std::vector<T> v(n);
  for (auto& x : v) {
    if constexpr (std::is_integral_v<T>) {
      x = static_cast<T>(static_cast<int64_t>(gen() % 2001) - 1000);
    } else {
      x = static_cast<T>((static_cast<double>(gen()) / 4294967296.0 - 0.5) * (rank + 1));
    }
  }
  return v;
}

// The sum the protocol must give: in rank order, one element at a time (bit-identical for floats).
template <typename T>
static std::vector<T> expected_sum(int world, int64_t n) {
  std::vector<std::vector<T>> in;
  for (int r = 0; r < world; ++r) in.push_back(rank_input<T>(r, n));
  std::vector<const T*> ptrs;
  for (auto& v : in) ptrs.push_back(v.data());
  std::vector<T> out(n);
  shm::sum_inputs(out.data(), ptrs, n);
  return out;
}

template <typename T>
static shm::BucketIo bucket_of(std::vector<T>& data, int32_t dtype_code) {
  shm::BucketIo io;
  io.numel = static_cast<int64_t>(data.size());
  io.element_bytes = sizeof(T);
  io.check_numel = io.numel;
  io.check_dtype = dtype_code;
  io.dtype_name = [](int32_t code) { return "dtype" + std::to_string(code); };
  T* base = data.data();
  io.copy_in = [base](char* slot, int64_t first, int64_t count) {
    std::memcpy(slot, base + first, count * sizeof(T));
  };
  io.copy_out = [base](const char* slot, int64_t first, int64_t count) {
    std::memcpy(base + first, slot, count * sizeof(T));
  };
  io.sum = [](char* out, const std::vector<const char*>& in, int64_t count) {
    std::vector<const T*> typed;
    for (auto* p : in) typed.push_back(reinterpret_cast<const T*>(p));
    shm::sum_inputs(reinterpret_cast<T*>(out), typed, count);
  };
  return io;
}

constexpr int64_t kChunk = 4096;  // 1024 floats per slot: most sizes span several chunks
const std::vector<int64_t> kSizes = {0, 1, 17, 1023, 1024, 1025, 5000};

// Every size and dtype in sequence, as `rank`; returns the number of wrong results.
static int run_rank(shm::Segment& segment, int rank, int world) {
  shm::WaitLimits limits;
  limits.timeout = std::chrono::seconds(30);
  uint64_t chunks = 0;
  int wrong = 0;
  auto one = [&](auto tag, int32_t code) {
    using T = decltype(tag);
    for (int64_t n : kSizes) {
      auto data = rank_input<T>(rank, n);
      shm::reduce(segment, rank, bucket_of(data, code), chunks, limits);
      if (data != expected_sum<T>(world, n)) ++wrong;
    }
  };
  one(float{}, 1);
  one(double{}, 2);
  one(int64_t{}, 3);
  one(int32_t{}, 4);
  one(int8_t{}, 5);
  return wrong;
}

static void test_threads_one_mapping(int world) {
  const std::string name = unique_name("threads");
  auto segment = shm::Segment::create(name, world, kChunk);
  segment->unlink();
  std::vector<std::thread> threads;
  std::vector<int> wrong(world, -1);
  std::vector<std::string> errors(world);
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      errors[r] = error_of([&] { wrong[r] = run_rank(*segment, r, world); });
      if (!errors[r].empty()) segment->stop(r);
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < world; ++r) {
    expect(errors[r].empty() && wrong[r] == 0,
           "threads, world " + std::to_string(world) + ", rank " + std::to_string(r) + ": " +
               std::to_string(wrong[r]) + " wrong sums " + errors[r]);
  }
}

static void test_threads_own_mappings(int world) {
  const std::string name = unique_name("attach");
  auto creator = shm::Segment::create(name, world, kChunk);
  std::vector<std::unique_ptr<shm::Segment>> segments;
  for (int r = 0; r < world; ++r) {
    segments.push_back(r == 0 ? std::move(creator) : shm::Segment::attach(name, world, kChunk));
  }
  segments[0]->unlink();
  std::vector<std::thread> threads;
  std::vector<int> wrong(world, -1);
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      if (!error_of([&] { wrong[r] = run_rank(*segments[r], r, world); }).empty()) {
        segments[r]->stop(r);
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < world; ++r) {
    expect(wrong[r] == 0, "own mappings, world " + std::to_string(world) + ": wrong sums");
  }
}

// Ranks as processes: forked before any thread exists; each attaches by name.
static void test_processes(int world) {
  const std::string name = unique_name("procs");
  auto segment = shm::Segment::create(name, world, kChunk);
  std::vector<pid_t> children;
  for (int r = 1; r < world; ++r) {
    const pid_t pid = fork();
    if (pid == 0) {
      int status = 3;
      try {
        auto mine = shm::Segment::attach(name, world, kChunk);
        mine->register_rank(r);
        status = run_rank(*mine, r, world) == 0 ? 0 : 1;
      } catch (const std::exception& e) {
        std::cerr << "rank " << r << ": " << e.what() << "\n";
        status = 2;
      }
      _exit(status);
    }
    children.push_back(pid);
  }
  segment->register_rank(0);
  int wrong = -1;
  const std::string error = error_of([&] { wrong = run_rank(*segment, 0, world); });
  if (!error.empty()) segment->stop(0);  // the children fail at once instead of timing out
  segment->unlink();
  expect(wrong == 0, "processes, world " + std::to_string(world) + ": rank 0 wrong sums " + error);
  for (pid_t pid : children) {
    int status = -1;
    waitpid(pid, &status, 0);
    expect(WIFEXITED(status) && WEXITSTATUS(status) == 0,
           "processes, world " + std::to_string(world) + ": a child failed");
  }
}

static void test_layout_and_timeouts() {
  expect(contains(error_of([] { shm::Layout::make(0, kChunk); }), "world size 0"), "world 0");
  expect(!error_of([] { shm::Layout::make(65, kChunk); }).empty(), "world 65");
  expect(!error_of([] { shm::Layout::make(2, 100); }).empty(), "chunk too small");
  expect(!error_of([] { shm::Layout::make(2, 4096 + 32); }).empty(), "chunk not 64-aligned");
  expect(!error_of([] { shm::Layout::make(2, INT64_MAX - 63); }).empty(), "chunk huge");
  const auto layout = shm::Layout::make(64, shm::kMaxChunkBytes);
  expect(layout.total_bytes == layout.data_offset + size_t(2) * 65 * shm::kMaxChunkBytes,
         "largest layout");
  using ms = std::chrono::milliseconds;
  expect(shm::timeout_from_seconds(std::numeric_limits<double>::infinity()) ==
             shm::kLongestTimeout, "inf -> the longest timeout");
  expect(shm::timeout_from_seconds(8.64e13) == shm::kLongestTimeout, "timedelta.max -> longest");
  expect(shm::timeout_from_seconds(std::nan("")) == ms(0), "nan -> 0");
  expect(shm::timeout_from_seconds(-1) == ms(0), "negative -> 0");
  expect(shm::timeout_from_seconds(1.5) == ms(1500), "1.5 s");
  expect(shm::clamp_timeout(ms::max()) == shm::kLongestTimeout, "clamp max");
}

static void test_integer_sums_wrap() {
  const int64_t a = INT64_MAX, b = 1;
  int64_t out = 0;
  shm::sum_inputs(&out, std::vector<const int64_t*>{&a, &b}, 1);
  expect(out == INT64_MIN, "int64 sum wraps like torch's");
  const int32_t c = INT32_MIN, d = -1;
  int32_t out32 = 0;
  shm::sum_inputs(&out32, std::vector<const int32_t*>{&c, &d, &d}, 1);
  expect(out32 == INT32_MAX - 1, "int32 sum wraps");
  const int8_t e = 100;
  int8_t out8 = 0;
  shm::sum_inputs(&out8, std::vector<const int8_t*>{&e, &e}, 1);
  expect(out8 == -56, "int8 sum wraps");
}

static void test_attach_checks() {
  const std::string name = unique_name("checks");
  auto segment = shm::Segment::create(name, 2, kChunk);
  expect(contains(error_of([&] { shm::Segment::attach(name, 3, kChunk); }), "size"),
         "attach with another world size is refused on the file size");
  expect(contains(error_of([&] { shm::Segment::attach(name, 2, 2 * kChunk); }), "size"),
         "attach with another chunk size is refused");
  // Mode: another user could have opened a 0644 (or 0666) segment.
  const int fd = shm_open(name.c_str(), O_RDWR, 0);
  fchmod(fd, 0644);
  expect(contains(error_of([&] { shm::Segment::attach(name, 2, kChunk); }), "mode is 0644"),
         "a segment of mode 0644 is refused");
  fchmod(fd, 0600);
  // Grown by someone: refused (sizes come from local values, the file must match exactly).
  const auto size = segment->layout().total_bytes;
  expect(ftruncate(fd, static_cast<off_t>(size + 4096)) == 0, "grow");
  expect(contains(error_of([&] { shm::Segment::attach(name, 2, kChunk); }), "size is"),
         "a grown segment is refused");
  expect(ftruncate(fd, static_cast<off_t>(size)) == 0, "shrink back");
  ::close(fd);
  // A regular file of the right size that is not a fused_reducer segment.
  const std::string other = unique_name("other");
  const int ofd = shm_open(other.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  expect(ftruncate(ofd, static_cast<off_t>(size)) == 0, "other size");
  ::close(ofd);
  expect(contains(error_of([&] { shm::Segment::attach(other, 2, kChunk); }), "another world size"),
         "a segment without the magic is refused");
  shm_unlink(other.c_str());
  expect(error_of([&] { shm::Segment::attach(name, 2, kChunk); }).empty(), "a sound one attaches");
  segment->unlink();
}

// See Note [Shared-memory segment trust]: a header rewritten after attach (here the
// world size and chunk size, by another mapping) changes no offset; the sums stay right.
static void test_header_rewritten_after_attach() {
  const int world = 2;
  const std::string name = unique_name("rewrite");
  auto a = shm::Segment::create(name, world, kChunk);
  auto b = shm::Segment::attach(name, world, kChunk);
  a->unlink();
  b->header().world = shm::kMaxWorld;
  b->header().chunk_bytes = int64_t(1) << 40;
  std::vector<int> wrong(world, -1);
  std::thread t0([&] { error_of([&] { wrong[0] = run_rank(*a, 0, world); }); });
  std::thread t1([&] { error_of([&] { wrong[1] = run_rank(*b, 1, world); }); });
  t0.join();
  t1.join();
  expect(wrong[0] == 0 && wrong[1] == 0, "a rewritten header changes nothing");
}

static void test_waits_end() {
  const std::string name = unique_name("waits");
  auto segment = shm::Segment::create(name, 3, kChunk);
  segment->unlink();
  shm::WaitLimits limits;
  limits.timeout = std::chrono::milliseconds(100);
  segment->arrive(0, 1);
  segment->arrive(2, 1);
  const auto start = std::chrono::steady_clock::now();
  const std::string timed_out = error_of([&] { segment->wait_for_all(1, "inputs", limits); });
  expect(contains(timed_out, "timed out after 100 ms waiting for rank 1 (inputs)"), timed_out);
  expect(std::chrono::steady_clock::now() - start < std::chrono::seconds(5), "timeout prompt");

  std::atomic<bool> cancelled{true};
  shm::WaitLimits cancel = limits;
  cancel.cancelled = &cancelled;
  bool was_cancel = false;
  try {
    segment->wait_for_all(1, "inputs", cancel);
  } catch (const shm::Cancelled&) {
    was_cancel = true;
  } catch (const std::exception&) {
  }
  expect(was_cancel, "a cancelled wait throws Cancelled");

  std::atomic<int64_t> abort_after{0};
  shm::WaitLimits closing = limits;
  closing.timeout = std::chrono::seconds(30);
  closing.abort_after_ns = &abort_after;
  expect(contains(error_of([&] { segment->wait_for_all(1, "sums", closing); }),
                  "closed while waiting for rank 1 (sums)"), "close() ends a wait");

  std::thread stopper([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    segment->stop(1);
  });
  shm::WaitLimits long_wait;
  long_wait.timeout = std::chrono::seconds(30);
  const std::string stopped = error_of([&] { segment->wait_for_all(1, "inputs", long_wait); });
  stopper.join();
  expect(contains(stopped, "rank 1 stopped reducing"), stopped);
}

// Sharded mode (Note [Shared-memory reduce-scatter and all-gather]): all-reduces,
// reduce-scatters and all-gathers interleaved on one segment, one mapping (ThreadSanitizer sees
// every access), sizes that are multiples of the world across chunk edges. A reduce-scatter's
// shard is bit-identical to the all-reduce's; an all-gather reconstructs every rank's shard.
// Back-to-back one-chunk all-gathers of changing sizes: no rank may read a peer's next size as
// this bucket's (the all-gather's extra wait after its first chunk's check).
static int run_sharded_rank(shm::Segment& segment, int rank, int world) {
  shm::WaitLimits limits;
  limits.timeout = std::chrono::seconds(30);
  uint64_t chunks = 0;
  int wrong = 0;
  auto shard_of = [&](const std::vector<float>& v, int owner) {
    const int64_t n = static_cast<int64_t>(v.size()) / world;
    return std::vector<float>(v.begin() + owner * n, v.begin() + (owner + 1) * n);
  };
  for (int64_t per_rank : {int64_t(0), int64_t(1), int64_t(17), int64_t(255), int64_t(256),
                           int64_t(257), int64_t(1000), int64_t(2500)}) {
    const int64_t n = per_rank * world;
    const auto input = rank_input<float>(rank, n);
    const auto sum = expected_sum<float>(world, n);
    auto scattered = input;
    shm::reduce_scatter(segment, rank, bucket_of(scattered, 1), chunks, limits);
    if (shard_of(scattered, rank) != shard_of(sum, rank)) ++wrong;
    auto reduced = input;
    shm::reduce(segment, rank, bucket_of(reduced, 1), chunks, limits);
    if (reduced != sum) ++wrong;
    std::vector<float> gathered(n, -7.0f);
    const auto mine = shard_of(input, rank);
    std::copy(mine.begin(), mine.end(), gathered.begin() + rank * per_rank);
    shm::all_gather(segment, rank, bucket_of(gathered, 1), chunks, limits);
    for (int r = 0; r < world; ++r) {
      if (shard_of(gathered, r) != shard_of(rank_input<float>(r, n), r)) ++wrong;
    }
  }
  for (int i = 0; i < 200; ++i) {  // one-chunk all-gathers of changing sizes, then an all-reduce
    const int64_t n = (1 + i % 5) * world;
    std::vector<int32_t> gathered(n, rank);
    shm::all_gather(segment, rank, bucket_of(gathered, 4), chunks, limits);
    for (int64_t j = 0; j < n; ++j) {
      if (gathered[j] != j / (n / world)) ++wrong;
    }
    std::vector<int32_t> ones(3, 1);
    shm::reduce(segment, rank, bucket_of(ones, 4), chunks, limits);
    if (ones != std::vector<int32_t>(3, world)) ++wrong;
  }
  return wrong;
}

static void test_sharded_threads(int world) {
  const std::string name = unique_name("sharded");
  auto segment = shm::Segment::create(name, world, kChunk);
  segment->unlink();
  std::vector<std::thread> threads;
  std::vector<int> wrong(world, -1);
  std::vector<std::string> errors(world);
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      errors[r] = error_of([&] { wrong[r] = run_sharded_rank(*segment, r, world); });
      if (!errors[r].empty()) segment->stop(r);
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < world; ++r) {
    expect(errors[r].empty() && wrong[r] == 0,
           "sharded, world " + std::to_string(world) + ", rank " + std::to_string(r) + ": " +
               std::to_string(wrong[r]) + " wrong results " + errors[r]);
  }
}

// Rank 0 runs one collective, the others another (or the same on another size): every rank
// raises naming both, none hangs, nothing is written into a bucket.
static void test_sharded_mismatch(int world, shm::Collective first, shm::Collective others,
                                  int64_t other_numel, const std::string& says) {
  const std::string name = unique_name("mismatch");
  auto segment = shm::Segment::create(name, world, kChunk);
  segment->unlink();
  std::vector<std::thread> threads;
  std::vector<std::string> errors(world);
  std::vector<int> touched(world, 0);
  const int64_t numel = 3000 * world;  // several chunks
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      shm::WaitLimits limits;
      limits.timeout = std::chrono::seconds(30);
      uint64_t chunks = 0;
      std::vector<float> data(r == 0 ? numel : other_numel, 1.0f);
      const shm::Collective op = r == 0 ? first : others;
      errors[r] = error_of([&] { shm::run(*segment, r, op, bucket_of(data, 1), chunks, limits); });
      segment->stop(r);
      for (float x : data) touched[r] += x != 1.0f;
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < world; ++r) {
    expect(contains(errors[r], says) && touched[r] == 0,
           "mismatch, world " + std::to_string(world) + ", rank " + std::to_string(r) +
               ": " + errors[r] + " (" + std::to_string(touched[r]) + " elements written)");
  }
}

static void test_sharded_refusals() {
  const std::string name = unique_name("refuse");
  auto segment = shm::Segment::create(name, 3, kChunk);
  segment->unlink();
  shm::WaitLimits limits;
  uint64_t chunks = 0;
  std::vector<float> data(10, 1.0f);
  for (auto op : {shm::Collective::kReduceScatter, shm::Collective::kAllGather}) {
    const std::string e =
        error_of([&] { shm::run(*segment, 0, op, bucket_of(data, 1), chunks, limits); });
    expect(contains(e, "multiple of the world size") && contains(e, "each of the 3 ranks") &&
               contains(e, "got 10 elements"),
           "a bucket of 10 elements is not sharded over 3 ranks: " + e);
  }
  expect(chunks == 0 && segment->header().ranks[0].arrived.load() == 0, "nothing was started");
  expect(shm::collective_name(7) == "an unknown collective (7)", shm::collective_name(7));
}

// A peer that exited (a zombie, not reaped yet) or whose pid now names another
// process (another start time) ends a wait within ~0.1 s.
static void test_dead_and_reused_peers() {
  const std::string name = unique_name("peers");
  auto segment = shm::Segment::create(name, 2, kChunk);
  segment->unlink();
  segment->register_rank(0);
  const pid_t child = fork();
  if (child == 0) {
    _exit(0);
  }
  segment->header().ranks[1].pid.store(child);
  segment->header().ranks[1].pid_namespace.store(shm::pid_namespace_id());
  expect(segment->peers_watchable(), "peers in this pid namespace are watchable");
  shm::WaitLimits limits;
  limits.timeout = std::chrono::seconds(30);
  limits.check_peers = true;
  segment->arrive(0, 1);
  auto start = std::chrono::steady_clock::now();
  const std::string dead = error_of([&] { segment->wait_for_all(1, "inputs", limits); });
  expect(contains(dead, "rank 1 (pid " + std::to_string(child) + ") exited"), dead);
  expect(std::chrono::steady_clock::now() - start < std::chrono::seconds(5), "dead peer prompt");
  waitpid(child, nullptr, 0);

  // This very process as rank 1, but with another start time: a reused pid.
  segment->header().ranks[1].pid.store(getpid());
  segment->header().ranks[1].start_time.store(shm::process_start_time(getpid()) + 1);
  const std::string reused = error_of([&] { segment->wait_for_all(1, "inputs", limits); });
  expect(contains(reused, "exited"), "a reused pid counts as exited: " + reused);

  // A peer of another pid namespace: its pid means nothing here, it is not watched.
  segment->header().ranks[1].pid_namespace.store(shm::pid_namespace_id() + 1);
  expect(!segment->peers_watchable(), "a peer in another pid namespace is not watched");
}


// The endings of a process, at the segment level (ThreadSanitizer and AddressSanitizer
// run this too). Every order ends in an error on the surviving ranks, promptly, never a hang.
static shm::BucketIo exiting_after(std::vector<float>& data, int64_t chunks_before_exit) {
  auto io = bucket_of(data, 1);
  auto copy_in = io.copy_in;
  auto copied = std::make_shared<int64_t>(0);
  io.copy_in = [copy_in, copied, chunks_before_exit](char* slot, int64_t first, int64_t count) {
    if ((*copied)++ == chunks_before_exit) _exit(0);  // a rank that ends mid-bucket
    copy_in(slot, first, count);
  };
  return io;
}

// A rank process exits (no destructor, as after SIGTERM or sys.exit in backward) before or
// between the chunks of a bucket the other rank is reducing: the survivor names it.
static void test_rank_exits_mid_bucket() {
  for (int64_t exit_at : {0, 1, 3}) {
    const std::string name = unique_name("exits");
    auto segment = shm::Segment::create(name, 2, kChunk);
    segment->register_rank(0);
    const pid_t child = fork();
    if (child == 0) {
      auto mine = shm::Segment::attach(name, 2, kChunk);
      mine->register_rank(1);
      auto data = rank_input<float>(1, 5 * 1024);
      uint64_t chunks = 0;
      shm::WaitLimits limits;
      limits.check_peers = true;
      shm::reduce(*mine, 1, exiting_after(data, exit_at), chunks, limits);
      _exit(3);  // never reached
    }
    while (segment->header().ranks[1].pid.load() == 0) std::this_thread::sleep_for(
        std::chrono::milliseconds(1));
    segment->unlink();
    expect(segment->peers_watchable(), "exits mid-bucket: peers watchable");
    auto data = rank_input<float>(0, 5 * 1024);
    uint64_t chunks = 0;
    shm::WaitLimits limits;
    limits.timeout = std::chrono::seconds(30);
    limits.check_peers = true;
    const auto start = std::chrono::steady_clock::now();
    const std::string error =
        error_of([&] { shm::reduce(*segment, 0, bucket_of(data, 1), chunks, limits); });
    expect(contains(error, "rank 1 (pid " + std::to_string(child) + ") exited"),
           "exit after " + std::to_string(exit_at) + " chunks: " + error);
    expect(std::chrono::steady_clock::now() - start < std::chrono::seconds(10),
           "a rank exiting mid-bucket is noticed promptly");
    int status = -1;
    waitpid(child, &status, 0);
    expect(WIFEXITED(status) && WEXITSTATUS(status) == 0, "the exiting rank exited 0");
  }
}

// Threads as ranks on their own mappings: after some buckets one rank stops (close() at the end
// of its training, or after an exception) while the others still reduce, then unmaps its
// segment before they have noticed; a closing rank with a bucket in flight gives up at its
// deadline. The others fail naming it, nobody hangs, and nothing is touched after unmapping.
static void test_stop_orders(int world) {
  for (int stop_after : {0, 1, 7}) {
    const std::string name = unique_name("stops");
    auto creator = shm::Segment::create(name, world, kChunk);
    std::vector<std::unique_ptr<shm::Segment>> segments;
    for (int r = 0; r < world; ++r) {
      segments.push_back(r == 0 ? std::move(creator) : shm::Segment::attach(name, world, kChunk));
    }
    segments[0]->unlink();
    std::atomic<int64_t> abort_after{INT64_MAX};
    std::vector<std::string> errors(world);
    std::vector<std::thread> threads;
    const int stopper = world - 1;
    for (int r = 0; r < world; ++r) {
      threads.emplace_back([&, r] {
        shm::WaitLimits limits;
        limits.timeout = std::chrono::seconds(30);
        if (r == 0) limits.abort_after_ns = &abort_after;  // rank 0 is closing meanwhile
        uint64_t chunks = 0;
        errors[r] = error_of([&] {
          for (int bucket = 0; bucket < 20; ++bucket) {
            if (r == stopper && bucket == stop_after) {
              segments[r]->stop(r);
              segments[r].reset();  // unmapped while the peers may still be waiting on it
              return;
            }
            auto data = rank_input<float>(r, 3 * 1024 + bucket);
            shm::reduce(*segments[r], r, bucket_of(data, 1), chunks, limits);
          }
        });
      });
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    abort_after = std::chrono::duration_cast<std::chrono::nanoseconds>(
                      std::chrono::steady_clock::now().time_since_epoch() +
                      std::chrono::seconds(20)).count();
    for (auto& t : threads) t.join();
    for (int r = 0; r < world; ++r) {
      if (r == stopper) continue;
      expect(contains(errors[r], "rank " + std::to_string(stopper) + " stopped reducing"),
             "stop after " + std::to_string(stop_after) + ", world " + std::to_string(world) +
                 ", rank " + std::to_string(r) + ": " + errors[r]);
    }
  }
}

int main() {
  test_layout_and_timeouts();
  test_integer_sums_wrap();
  test_attach_checks();
  test_dead_and_reused_peers();  // forks: before any thread of this process exists
  test_rank_exits_mid_bucket();  // forks too
  for (int world : {2, 3, 4, 8}) test_processes(world);
  for (int world : {1, 2, 3, 4, 8}) test_threads_one_mapping(world);
  test_threads_own_mappings(3);
  test_header_rewritten_after_attach();
  test_waits_end();
  for (int world : {2, 3, 4}) test_stop_orders(world);
  for (int world : {1, 2, 3, 4}) test_sharded_threads(world);
  using C = shm::Collective;
  for (int world : {2, 3}) {
    const int64_t same = 3000 * world;
    test_sharded_mismatch(world, C::kReduceScatter, C::kAllReduce, same,
                          "ranks run different collectives");
    test_sharded_mismatch(world, C::kAllGather, C::kReduceScatter, same,
                          "ranks run different collectives");
    test_sharded_mismatch(world, C::kAllReduce, C::kAllGather, same,
                          "ranks run different collectives");
    test_sharded_mismatch(world, C::kReduceScatter, C::kReduceScatter, 2 * same,
                          "ranks reduce-scatter different buckets");
    test_sharded_mismatch(world, C::kAllGather, C::kAllGather, 2 * same,
                          "ranks all-gather different buckets");
  }
  test_sharded_refusals();
  if (failures != 0) {
    std::cerr << failures << " failure(s)\n";
    return 1;
  }
  std::cout << "shm segment: all tests passed\n";
  return 0;
}
