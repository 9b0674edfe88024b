// Python bindings: the only file that knows about pybind11.
#include <torch/extension.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/utils/pybind.h>

#include "bucket_assignment.h"
#include "process_group_transport.h"
#include "reducer.h"

namespace py = pybind11;
using fused_reducer::Reducer;

namespace {

std::unique_ptr<Reducer> make_reducer(std::vector<at::Tensor> params,
                                      std::vector<std::string> names,
                                      const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                      const std::string& control_device,
                                      int64_t first_bucket_bytes,
                                      int64_t bucket_cap_bytes,
                                      bool gradient_as_bucket_view,
                                      bool find_unused_parameters,
                                      double timeout_seconds) {
  fused_reducer::ReducerOptions options;
  options.first_bucket_bytes = first_bucket_bytes;
  options.bucket_cap_bytes = bucket_cap_bytes;
  options.gradient_as_bucket_view = gradient_as_bucket_view;
  options.find_unused_parameters = find_unused_parameters;
  options.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_seconds * 1000));
  auto transport = std::make_unique<fused_reducer::ProcessGroupTransport>(group);
  return std::make_unique<Reducer>(std::move(params), std::move(names), group,
                                   at::Device(control_device), std::move(transport), options);
}

py::dict stats_dict(const Reducer& reducer) {
  const auto s = reducer.stats();
  py::dict d;
  d["step"] = s.step;
  d["allreduces"] = s.allreduces;
  d["allreduce_bytes"] = s.allreduce_bytes;
  d["rebuilds"] = s.rebuilds;
  d["first_bucket_bytes"] = s.first_bucket_bytes;
  d["bucket_cap_bytes"] = s.bucket_cap_bytes;
  d["buckets"] = s.buckets;
  d["transport"] = s.transport;
  return d;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "FusedReducer C++ core: bucket assignment, reducer, transports";

  m.def("assign_buckets",
        [](const std::vector<int64_t>& bytes, const std::vector<int64_t>& groups,
           const std::vector<int64_t>& order, int64_t first_bytes, int64_t cap_bytes) {
          TORCH_CHECK(bytes.size() == groups.size(), "assign_buckets: one group per tensor");
          std::vector<fused_reducer::TensorInfo> infos;
          for (size_t i = 0; i < bytes.size(); ++i) {
            infos.push_back({bytes[i], groups[i]});
          }
          return fused_reducer::assign_buckets(infos, order, {first_bytes, cap_bytes});
        },
        py::arg("bytes"), py::arg("groups"), py::arg("order"), py::arg("first_bytes"),
        py::arg("cap_bytes"),
        "Bucket assignment (see Note [Bucket assignment]); returns parameter indices per bucket.");

  py::class_<Reducer>(m, "Reducer")
      .def(py::init(&make_reducer), py::arg("params"), py::arg("names"), py::arg("group"),
           py::arg("control_device"), py::arg("first_bucket_bytes"), py::arg("bucket_cap_bytes"),
           py::arg("gradient_as_bucket_view"), py::arg("find_unused_parameters"),
           py::arg("timeout_seconds"))
      .def("prepare_forward", &Reducer::prepare_forward, py::arg("will_sync"),
           py::call_guard<py::gil_scoped_release>())
      .def("set_sync_enabled", &Reducer::set_sync_enabled)
      .def("request_rebuild", &Reducer::request_rebuild)
      .def_property("first_bucket_bytes", &Reducer::first_bucket_bytes,
                    &Reducer::set_first_bucket_bytes)
      .def_property("bucket_cap_bytes", &Reducer::bucket_cap_bytes,
                    &Reducer::set_bucket_cap_bytes)
      .def("bucket_sizes", &Reducer::bucket_sizes)
      .def("bucket_params", &Reducer::bucket_params)
      .def("stats", &stats_dict);

  // The reducer's transport on its own, for the bandwidth benchmark: the same code path a
  // bucket takes, on a flat buffer the caller owns.
  py::class_<fused_reducer::PendingCollective>(m, "PendingCollective")
      .def("wait",
           [](fused_reducer::PendingCollective& pending, double timeout_seconds) {
             pending.wait(std::chrono::milliseconds(static_cast<int64_t>(timeout_seconds * 1000)));
           },
           py::arg("timeout_seconds") = 600.0, py::call_guard<py::gil_scoped_release>());
  py::class_<fused_reducer::Transport>(m, "Transport")
      .def("allreduce_sum", &fused_reducer::Transport::allreduce_sum, py::arg("flat"),
           py::call_guard<py::gil_scoped_release>(),
           "Start an in-place sum all-reduce of a contiguous tensor; wait() on the result.")
      .def_property_readonly("name", &fused_reducer::Transport::name);
  m.def("make_transport",
        [](const c10::intrusive_ptr<c10d::ProcessGroup>& group) -> std::unique_ptr<fused_reducer::Transport> {
          return std::make_unique<fused_reducer::ProcessGroupTransport>(group);
        },
        py::arg("group"));

  m.def("build_info", [] {
    py::dict info;
    info["cuda"] = false;
    return info;
  });
}
