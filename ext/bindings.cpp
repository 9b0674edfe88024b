// Python bindings: the only file that knows about pybind11.
#include <torch/extension.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/utils/pybind.h>

#include <cmath>

#include "bucket_assignment.h"
#include "bucket_copy.h"
#include "process_group_transport.h"
#include "shm_transport.h"
#include "reducer.h"
#include "transport_registry.h"

#ifdef FUSED_REDUCER_WITH_CUDA
#include "nccl_transport.h"
#endif

namespace py = pybind11;
using fused_reducer::Reducer;

namespace {

std::unique_ptr<Reducer> make_reducer(std::vector<at::Tensor> params,
                                      std::vector<std::string> names,
                                      const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                      const std::string& control_device,
                                      std::shared_ptr<fused_reducer::Transport> transport,
                                      const fused_reducer::ReducerOptions& options) {
  return std::make_unique<Reducer>(std::move(params), std::move(names), group,
                                   at::Device(control_device), std::move(transport), options);
}

// A communication hook's collective: `finish` (Python) waits on the hook's
// future and writes its result into the bucket. Python objects are touched
// only with the GIL held, whichever thread finishes the backward.
class PendingPythonHook : public fused_reducer::PendingCollective {
 public:
  explicit PendingPythonHook(py::object finish) : finish_(std::move(finish)) {}
  ~PendingPythonHook() override {
    py::gil_scoped_acquire gil;
    finish_ = py::object();
  }
  void wait(std::chrono::milliseconds /*timeout: the hook's own collectives bound it*/) override {
    py::gil_scoped_acquire gil;
    finish_();
  }

 private:
  py::object finish_;
};

// `launch(index, is_last, flat, views, params)` (Python) calls the user's hook
// and returns the `finish` callable above.
fused_reducer::CommHook python_comm_hook(py::object launch) {
  std::shared_ptr<py::object> holder(new py::object(std::move(launch)), [](py::object* p) {
    py::gil_scoped_acquire gil;
    delete p;
  });
  return [holder](int64_t index, bool is_last, const at::Tensor& flat,
                  const std::vector<at::Tensor>& views, const std::vector<int64_t>& params)
             -> std::unique_ptr<fused_reducer::PendingCollective> {
    py::gil_scoped_acquire gil;
    py::object finish = (*holder)(index, is_last, flat, views, params);
    return std::make_unique<PendingPythonHook>(std::move(finish));
  };
}

// A reduce dtype as stats and telemetry show it: str(torch.dtype), or None
// (each gradient's own dtype). Strings keep stats() JSON-serialisable.
py::object dtype_or_none(std::optional<at::ScalarType> dtype) {
  return dtype ? py::object(py::str(py::cast(*dtype))) : py::none();
}

// NaN (a time that was never taken) -> None.
py::object time_or_none(double us) {
  return std::isnan(us) ? py::none() : py::object(py::float_(us));
}

py::list bucket_dicts(const fused_reducer::StepTiming& step) {
  py::list out;
  for (size_t b = 0; b < step.buckets.size(); ++b) {
    const auto& t = step.buckets[b];
    py::dict d;
    d["bucket"] = b;
    d["bytes"] = t.bytes;
    d["params"] = t.params;
    d["ready_first_us"] = time_or_none(t.ready_first_us);
    d["ready_last_us"] = time_or_none(t.ready_last_us);
    d["launch_us"] = time_or_none(t.launch_us);
    d["pack_us"] = time_or_none(t.pack_us);
    d["complete_us"] = time_or_none(t.complete_us);
    d["wait_us"] = time_or_none(t.wait_us);
    out.append(d);
  }
  return out;
}

// One step of telemetry as a dict. See Note [Step telemetry].
py::dict step_dict(const fused_reducer::StepTiming& step) {
  py::dict d;
  d["step"] = step.step;
  d["origin_us"] = step.origin_us;
  d["forward_us"] = step.forward_us;
  d["backward_end_us"] = step.backward_end_us;
  d["finalize_end_us"] = step.finalize_end_us;
  d["exposed_wait_us"] = step.exposed_wait_us;
  d["overlap"] = step.overlap;
  d["first_bucket_bytes"] = step.bucket_caps_bytes.front();
  d["bucket_cap_bytes"] = step.bucket_caps_bytes.back();
  d["bucket_caps_bytes"] = step.bucket_caps_bytes;
  d["last_bucket_bytes"] = step.last_bucket_bytes;
  d["reduce_dtype"] = dtype_or_none(step.reduce_dtype);
  d["buckets"] = bucket_dicts(step);
  d["lateness_ms"] = step.lateness_ms;
  return d;
}

py::dict straggler_dict(const fused_reducer::StragglerReport& report) {
  py::dict d;
  d["step"] = report.step;
  d["lateness_ms"] = report.lateness_ms;
  d["slack_ms"] = report.slack_ms;
  d["slowest"] = report.slowest >= 0 ? py::object(py::int_(report.slowest)) : py::object(py::none());
  d["stragglers"] = report.stragglers;
  d["late_steps"] = report.late_steps;
  d["threshold_ms"] = report.threshold_ms;
  d["median_step_ms"] = report.median_step_ms;
  d["jitter_ms"] = report.jitter_ms;
  d["interval"] = report.interval;
  d["window"] = report.window;
  return d;
}

py::dict stats_dict(const Reducer& reducer) {
  const auto s = reducer.stats();
  py::dict d;
  d["step"] = s.step;
  d["allreduces"] = s.allreduces;
  d["allreduce_bytes"] = s.allreduce_bytes;
  d["health_exchanges"] = s.health_exchanges;
  d["health_exchange_bytes"] = s.health_exchange_bytes;
  d["rebuilds"] = s.rebuilds;
  d["copy_launches"] = s.copy_launches;
  d["first_bucket_bytes"] = s.bucket_caps_bytes.front();
  d["bucket_cap_bytes"] = s.bucket_caps_bytes.back();
  d["bucket_caps_bytes"] = s.bucket_caps_bytes;
  d["last_bucket_bytes"] = s.last_bucket_bytes;
  d["buckets"] = s.buckets;
  d["reduce_dtype"] = dtype_or_none(s.reduce_dtype);
  d["transport"] = s.transport;
  // Telemetry of the last completed step (see Note [Step telemetry]).
  const auto history = reducer.history();
  if (history.empty()) {
    d["buckets_detail"] = py::list();
    d["overlap"] = py::none();
    d["exposed_wait_us"] = py::none();
    d["backward_end_us"] = py::none();
  } else {
    const auto& last = history.back();
    d["buckets_detail"] = bucket_dicts(last);
    d["overlap"] = last.overlap;
    d["exposed_wait_us"] = last.exposed_wait_us;
    d["backward_end_us"] = last.backward_end_us;
  }
  return d;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "FusedReducer C++ core: bucket assignment, reducer, transports";

  // The reducer's refusals of a model or setting reach Python as the package's own error.
  py::register_exception_translator([](std::exception_ptr raised) {
    try {
      if (raised) {
        std::rethrow_exception(raised);
      }
    } catch (const fused_reducer::ModelSettingError& e) {
      py::object error = py::module_::import("fused_reducer.errors").attr("FusedReducerError");
      PyErr_SetString(error.ptr(), e.what());
    }
  });

  // The checks of the limits and the reduce dtype, written once here: Python calls them for
  // values it holds before a Reducer exists (the constructor, the process default).
  m.def("check_bucket_bytes", &fused_reducer::check_bucket_bytes, py::arg("setting"),
        py::arg("bytes"));
  m.def("check_bucket_caps", &fused_reducer::check_bucket_caps, py::arg("caps"));
  m.def("check_last_bucket_bytes", &fused_reducer::check_last_bucket_bytes, py::arg("bytes"));
  m.def("check_reduce_dtype", &fused_reducer::check_reduce_dtype, py::arg("reduce_dtype"));
  m.def("check_health_options", &fused_reducer::check_health_options, py::arg("options"));
  m.def("check_bucket_view_dtypes", &fused_reducer::check_bucket_view_dtypes,
        py::arg("gradient_as_bucket_view"), py::arg("reduce_dtype"), py::arg("param_dtypes"),
        py::arg("names"));

  m.def("assign_buckets",
        [](const std::vector<int64_t>& bytes, const std::vector<int64_t>& groups,
           const std::vector<int64_t>& order, const std::vector<int64_t>& caps,
           int64_t last_bytes) {
          TORCH_CHECK(bytes.size() == groups.size(), "assign_buckets: one group per tensor");
          std::vector<fused_reducer::TensorInfo> infos;
          for (size_t i = 0; i < bytes.size(); ++i) {
            infos.push_back({bytes[i], groups[i]});
          }
          return fused_reducer::assign_buckets(infos, order, {caps, last_bytes});
        },
        py::arg("bytes"), py::arg("groups"), py::arg("order"), py::arg("caps"),
        py::arg("last_bytes") = 0,
        "Bucket assignment (see Note [Bucket assignment]); returns parameter indices per bucket.");

  // What a Reducer is built with (ext/reducer_options.h): fields read and written by name.
  using fused_reducer::HealthOptions;
  using fused_reducer::ReducerOptions;
  py::class_<HealthOptions> health_options(m, "HealthOptions");
  health_options.def(py::init<>());
  fused_reducer::for_each_health_option(
      [&](const char* name, auto field) { health_options.def_readwrite(name, field); });
  py::class_<ReducerOptions>(m, "ReducerOptions")
      .def(py::init<>())
      .def_readwrite("bucket_caps_bytes", &ReducerOptions::bucket_caps_bytes)
      .def_readwrite("ddp_first_layout", &ReducerOptions::ddp_first_layout)
      .def_readwrite("last_bucket_bytes", &ReducerOptions::last_bucket_bytes)
      .def_readwrite("gradient_as_bucket_view", &ReducerOptions::gradient_as_bucket_view)
      .def_readwrite("find_unused_parameters", &ReducerOptions::find_unused_parameters)
      .def_readwrite("skip_all_reduce_unused_params",
                     &ReducerOptions::skip_all_reduce_unused_params)
      .def_property(
          "timeout_seconds",
          [](const ReducerOptions& options) {
            return std::chrono::duration<double>(options.timeout).count();
          },
          [](ReducerOptions& options, double seconds) {
            options.timeout = fused_reducer::shm::timeout_from_seconds(seconds);
          })
      .def_readwrite("reduce_dtype", &ReducerOptions::reduce_dtype)
      .def_readwrite("health", &ReducerOptions::health);

  py::class_<Reducer>(m, "Reducer")
      .def(py::init(&make_reducer), py::arg("params"), py::arg("names"), py::arg("group"),
           py::arg("control_device"), py::arg("transport"), py::arg("options"))
      .def("prepare_forward", &Reducer::prepare_forward, py::arg("will_sync"),
           py::call_guard<py::gil_scoped_release>())
      .def("on_outputs_reached", &Reducer::on_outputs_reached,
           py::call_guard<py::gil_scoped_release>())
      .def("set_sync_enabled", &Reducer::set_sync_enabled)
      .def("set_divide_factor", &Reducer::set_divide_factor, py::arg("ranks"))
      .def("set_comm_hook",
           [](Reducer& reducer, py::object launch) {
             reducer.set_comm_hook(python_comm_hook(std::move(launch)));
           },
           py::arg("launch"))
      .def("has_comm_hook", &Reducer::has_comm_hook)
      .def("zero_buckets",
           [](const Reducer& reducer) {
             py::list out;
             for (const auto& zero : reducer.zero_buckets()) {
               out.append(py::make_tuple(zero.flat, zero.views, zero.params, zero.is_last));
             }
             return out;
           },
           "Per bucket in launch order: (zeros like the flat buffer, its views, parameter "
           "indices, is_last), for a joined rank to shadow the others' reduction.")
      .def("note_shadowed_step", &Reducer::note_shadowed_step)
      .def("joined_used_map", &Reducer::joined_used_map,
           "find_unused_parameters: the used map a joined rank all-reduces (in place), as DDP")
      .def("bucket_numels", &Reducer::bucket_numels)
      .def("set_sharded", &Reducer::set_sharded, py::arg("sharded"))
      .def("sharded", &Reducer::sharded)
      .def("sharded_layout", &Reducer::sharded_layout)
      .def("set_released_gradients", &Reducer::set_released_gradients, py::arg("placeholders"))
      .def("clear_released_gradients", &Reducer::clear_released_gradients)
      .def("bucket_flats", &Reducer::bucket_flats)
      .def("bucket_offsets", &Reducer::bucket_offsets)
      .def("request_rebuild", &Reducer::request_rebuild)
      .def("request_rebuild_from_order", &Reducer::request_rebuild_from_order, py::arg("order"),
           "Rebuild at the next forward from this parameter order (a joining replica's layout).")
      .def("rebuild_pending", &Reducer::rebuild_pending,
           "Whether the next forward rebuilds the layout.")
      .def_property("bucket_caps_bytes", &Reducer::bucket_caps_bytes,
                    &Reducer::set_bucket_caps_bytes)
      .def_property("first_bucket_bytes", &Reducer::first_bucket_bytes,
                    &Reducer::set_first_bucket_bytes)
      .def_property("bucket_cap_bytes", &Reducer::bucket_cap_bytes,
                    &Reducer::set_bucket_cap_bytes)
      .def_property("last_bucket_bytes", &Reducer::last_bucket_bytes,
                    &Reducer::set_last_bucket_bytes)
      .def_property("reduce_dtype", &Reducer::reduce_dtype, &Reducer::set_reduce_dtype,
                    "dtype of the buckets of floating-point gradients (None: their own); "
                    "see Note [Reduce dtype]")
      .def("history",
           [](const Reducer& reducer) {
             py::list out;
             for (const auto& step : reducer.history()) {
               out.append(step_dict(step));
             }
             return out;
           },
           "Telemetry of the last steps kept, oldest first (see Note [Step telemetry]).")
      .def("last_ready_times", &Reducer::last_ready_times,
           "Per parameter: us after the first hook its gradient was ready in the last step.")
      .def("last_ready_order", &Reducer::last_ready_order,
           "The order the next rebuild would use (last observed, completed).")
      .def("set_trace_capacity", &Reducer::set_trace_capacity, py::arg("steps"))
      .def("completed_steps", &Reducer::completed_steps)
      .def("bucket_sizes", &Reducer::bucket_sizes)
      .def("bucket_params", &Reducer::bucket_params)
      .def("stats", &stats_dict)
      .def("set_nonfinite_handler",
           [](Reducer& reducer, py::function raise) {
             // Called at the end of backward, on whichever thread finishes it: the Python
             // exception it raises travels through autograd to loss.backward()'s caller.
             std::shared_ptr<py::object> holder(new py::object(std::move(raise)),
                                                [](py::object* p) {
                                                  py::gil_scoped_acquire gil;
                                                  delete p;
                                                });
             reducer.set_nonfinite_handler([holder](const std::string& message) {
               py::gil_scoped_acquire gil;
               (*holder)(message);
             });
           },
           py::arg("raise_error"))
      .def("straggler_report",
           [](const Reducer& reducer) { return straggler_dict(reducer.straggler_report()); })
      .def("take_straggler_warning", &Reducer::take_straggler_warning)
      .def("begin_forward_sync", &Reducer::begin_forward_sync)
      .def("end_forward_sync", &Reducer::end_forward_sync)
      .def("shadow_health_exchange", &Reducer::shadow_health_exchange,
           py::call_guard<py::gil_scoped_release>())
      .def("copy_norms", &Reducer::copy_norms,
           "float64 [sum x^2, sum |x|, max |x|] of param.grad as the last step wrote it, or "
           "None when param.grad changed since (Note [Statistics from the copy]).");

  // Transports: the reducer takes one; the bandwidth benchmark drives one alone on a flat
  // buffer it owns (the same code path a bucket takes).
  py::class_<fused_reducer::PendingCollective>(m, "PendingCollective")
      .def("wait",
           [](fused_reducer::PendingCollective& pending, double timeout_seconds) {
             pending.wait(fused_reducer::shm::timeout_from_seconds(timeout_seconds));
           },
           py::arg("timeout_seconds") = 600.0, py::call_guard<py::gil_scoped_release>());
  py::class_<fused_reducer::Transport, std::shared_ptr<fused_reducer::Transport>>(m, "Transport")
      .def("allreduce_sum", &fused_reducer::Transport::allreduce_sum, py::arg("flat"),
           py::call_guard<py::gil_scoped_release>(),
           "Start an in-place sum all-reduce of a contiguous tensor; wait() on the result.")
      .def("reduce_scatter_sum", &fused_reducer::Transport::reduce_scatter_sum, py::arg("flat"),
           py::arg("label") = "", py::call_guard<py::gil_scoped_release>(),
           "Start an in-place sum reduce-scatter of a flat tensor of world_size equal shards: "
           "after wait(), this rank's shard (the rank-th) holds the sum of every rank's, the same "
           "as allreduce_sum's; the other shards are unspecified. `label` names it in errors.")
      .def("all_gather", &fused_reducer::Transport::all_gather, py::arg("flat"),
           py::arg("label") = "", py::call_guard<py::gil_scoped_release>(),
           "Start an in-place all-gather of a flat tensor of world_size equal shards: after "
           "wait(), every shard holds its owner's (each rank contributes its own shard).")
      .def_property_readonly("name", &fused_reducer::Transport::name)
      .def("check", &fused_reducer::Transport::check, py::call_guard<py::gil_scoped_release>(),
           "Raise the error of a collective that failed in the background, if any.")
      .def("close",
           [](fused_reducer::Transport& transport, double deadline_seconds) {
             transport.close(fused_reducer::shm::timeout_from_seconds(deadline_seconds));
           },
           py::arg("deadline_seconds") = 10.0, py::call_guard<py::gil_scoped_release>(),
           "Release the communicator (in-flight work gets until the deadline, then abort).");
  py::class_<fused_reducer::ProcessGroupTransport, fused_reducer::Transport,
             std::shared_ptr<fused_reducer::ProcessGroupTransport>>(m, "ProcessGroupTransport")
      .def(py::init<c10::intrusive_ptr<c10d::ProcessGroup>>(), py::arg("group"))
      .def("set_peer_processes", &fused_reducer::ProcessGroupTransport::set_peer_processes,
           py::arg("rank_pids"),
           "(rank, pid) of the peers on this host, named in errors once their process exited.");
  py::class_<fused_reducer::ShmTransport, fused_reducer::Transport,
             std::shared_ptr<fused_reducer::ShmTransport>>(m, "ShmTransport")
      .def(py::init([](const std::string& name, bool create, int rank, int world_size,
                       int64_t chunk_bytes, double timeout_seconds) {
             return std::make_shared<fused_reducer::ShmTransport>(
                 name, create, rank, world_size, chunk_bytes,
                 fused_reducer::shm::timeout_from_seconds(timeout_seconds));
           }),
           py::arg("name"), py::arg("create"), py::arg("rank"), py::arg("world_size"),
           py::arg("chunk_bytes"), py::arg("timeout_seconds"))
      .def("unlink", &fused_reducer::ShmTransport::unlink,
           "Remove the segment's name once every rank has mapped it.")
      .def("start_peer_checks", &fused_reducer::ShmTransport::start_peer_checks,
           "Once every rank has mapped the segment: watch the peers' processes while waiting.");

  // Every transport by name (ext/transport_registry.h): the one way Python makes a transport.
  using fused_reducer::TransportArgs;
  py::class_<TransportArgs>(m, "TransportArgs")
      .def(py::init<>())
      .def_readwrite("group", &TransportArgs::group)
      .def_property(
          "id", [](const TransportArgs& args) { return py::bytes(args.id); },
          [](TransportArgs& args, const std::string& id) { args.id = id; })
      .def_readwrite("create", &TransportArgs::create)
      .def_readwrite("rank", &TransportArgs::rank)
      .def_readwrite("world_size", &TransportArgs::world_size)
      .def_readwrite("device", &TransportArgs::device)
      .def_readwrite("chunk_bytes", &TransportArgs::chunk_bytes)
      .def_property(
          "timeout_seconds",
          [](const TransportArgs& args) {
            return std::chrono::duration<double>(args.timeout).count();
          },
          [](TransportArgs& args, double seconds) {
            args.timeout = fused_reducer::shm::timeout_from_seconds(seconds);
          });
  // Joining a transport waits for the peers (NCCL init), so it runs without the GIL; released
  // inside, not by call_guard, because pybind11 registers the new instance (Python objects)
  // after the function returns, and that needs the GIL. The object is the transport's own
  // class (ShmTransport, ...): pybind11 returns the most derived type bound above.
  m.def("make_registered_transport",
        [](const std::string& name, const TransportArgs& args) {
          py::gil_scoped_release no_gil;
          return fused_reducer::make_registered_transport(name, args);
        },
        py::arg("name"), py::arg("args"));
  m.def("registered_transports", &fused_reducer::registered_transports,
        "The names of the transports this build registered, sorted.");

  m.def("settle_released_works",
        [](double deadline_seconds) {
          return fused_reducer::settle_released_works(
              fused_reducer::shm::timeout_from_seconds(deadline_seconds));
        },
        py::arg("deadline_seconds"), py::call_guard<py::gil_scoped_release>(),
        "Drop the process-group works the reducer released while their backend still held them, "
        "waiting up to deadline_seconds; returns how many the backend still holds (never "
        "released). See Note [Releasing process-group work].");

  // Fused copy, exposed for the kernel tests and the copy benchmark.
  m.def("scaled_copy",
        [](const std::vector<at::Tensor>& srcs, const std::vector<at::Tensor>& dsts, double scale) {
          TORCH_CHECK(srcs.size() == dsts.size(), "scaled_copy: one destination per source");
          std::vector<fused_reducer::CopyJob> jobs;
          for (size_t i = 0; i < srcs.size(); ++i) {
            jobs.push_back({srcs[i], dsts[i]});
          }
          return fused_reducer::scaled_copy(jobs, scale);
        },
        py::arg("srcs"), py::arg("dsts"), py::arg("scale"),
        "dst = src * scale for each pair (see Note [Bucket copies]); returns fused launches.");

  py::dict info;
#ifdef FUSED_REDUCER_WITH_CUDA
  py::class_<fused_reducer::NcclTransport, fused_reducer::Transport,
             std::shared_ptr<fused_reducer::NcclTransport>>(m, "NcclTransport")
      // NCCL init waits for the peers, so it runs without the GIL; released inside the factory,
      // not by call_guard on py::init, because pybind11 registers the new instance (Python
      // objects) after the factory returns, and that needs the GIL.
      .def(py::init([](const std::string& unique_id, int rank, int world_size, int device,
                       double timeout_seconds) {
             const auto timeout = fused_reducer::shm::timeout_from_seconds(timeout_seconds);
             py::gil_scoped_release no_gil;
             return std::make_shared<fused_reducer::NcclTransport>(unique_id, rank, world_size,
                                                                   device, timeout);
           }),
           py::arg("unique_id"), py::arg("rank"), py::arg("world_size"), py::arg("device"),
           py::arg("timeout_seconds"));
  m.def("nccl_unique_id", [] { return py::bytes(fused_reducer::nccl_unique_id()); });
  info["cuda"] = true;
  info["nccl_version"] = fused_reducer::nccl_version();
  info["cuda_arch_list"] = std::string(FUSED_REDUCER_CUDA_ARCH_LIST);
#else
  info["cuda"] = false;
  info["nccl_version"] = py::none();
  info["cuda_arch_list"] = "";
#endif
  m.attr("BUILD_INFO") = info;
}
