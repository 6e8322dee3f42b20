// Python binding. Tensors cross as integer addresses, sizes, strides and a format tag: no torch here.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "job_threads.h"
#include "runner.h"

namespace py = pybind11;
using namespace killick;

namespace {

using Int64s = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

std::vector<int64_t> to_vector(const Int64s& a) {
  if (a.ndim() != 1) throw std::invalid_argument("expected a one-dimensional int64 array");
  std::vector<int64_t> out(size_t(a.shape(0)));
  if (!out.empty()) std::memcpy(out.data(), a.data(), out.size() * sizeof(int64_t));
  return out;
}

}  // namespace

PYBIND11_MODULE(_cpu_experts, m) {
  m.doc() = "killick native CPU expert kernels (SwiGLU experts on a pinned worker pool)";
  m.def("supported_isas", &supported_isas, "ISAs this machine and build can run, best first");
  m.def("physical_cpus", &physical_cpus, "one CPU id per physical core in the process's affinity mask");
  m.attr("FORMAT_F32") = int(kF32);
  m.attr("FORMAT_BF16") = int(kBF16);
  m.attr("MAX_TOKENS_PER_PASS") = kMaxTokens;
  m.attr("MAX_TILE_TOKENS") = kMaxTileTokens;
  py::class_<Table>(m, "Table")
      .def(py::init<int, int, int, uint64_t, int64_t, int64_t, uint64_t, int64_t, int64_t, int64_t>(),
           py::arg("fmt"), py::arg("H"), py::arg("I"), py::arg("gu_ptr"), py::arg("gu_expert_stride"),
           py::arg("gu_row_stride"), py::arg("dn_ptr"), py::arg("dn_expert_stride"), py::arg("dn_row_stride"),
           py::arg("E"));
  py::class_<Runner>(m, "Runner")
      .def(py::init<int, bool, int, int>(), py::arg("threads"), py::arg("pin") = true, py::arg("spin_us") = 2000,
           py::arg("caller_joins") = -1)
      .def_property_readonly("threads", [](Runner& r) { return r.pool.threads(); })
      .def_property_readonly("cpus", [](Runner& r) { return r.pool.cpus(); })
      .def_property_readonly("caller_joins", [](Runner& r) { return r.pool.caller_joins(); })
      .def_property("isa", [](Runner& r) { return r.isa; }, &Runner::set_isa)
      .def_readwrite("row_block", &Runner::row_block)
      .def_readwrite("claim_rows", &Runner::claim_rows)
      .def_readwrite("guided", &Runner::guided)
      .def_readwrite("least_claim", &Runner::least_claim)
      .def_readwrite("prefetch_hint", &Runner::prefetch_hint)
      .def_readwrite("prefetch_bytes", &Runner::prefetch_bytes)
      .def_readwrite("tile_tokens", &Runner::tile_tokens)
      .def_property_readonly("has_tiles", [](Runner& r) { return r.kernels->tile != nullptr; })
      .def_property_readonly(
          "last_tiles", [](Runner& r) { py::gil_scoped_release release; return r.planner_last_tiles(); },
          "whether the last job took the tile path (waits, the GIL let go, while a posted job holds the runner)")
      .def("submit_moe", &Runner::submit_moe)
      .def("run_gather", &Runner::run_gather, py::arg("table"), py::arg("experts"), py::arg("rows"), py::arg("x"),
           py::arg("x_fmt"), py::arg("x_stride"), py::arg("T"), py::arg("out"), py::arg("out_fmt"),
           py::arg("out_stride"))
      .def("submit_table", &Runner::submit_table, py::arg("table"), py::arg("experts"), py::arg("tokens"),
           py::arg("weights"), py::arg("x"), py::arg("x_stride"), py::arg("y"), py::arg("y_stride"), py::arg("T"),
           py::arg("wait") = false)
      .def("set_profile", [](Runner& r, bool on) { py::gil_scoped_release release; r.pool.set_profile(on); },
           "start or stop timestamping jobs (the sums restart from zero); waits for the job in flight first")
      .def("profile", [](Runner& r) {
        PoolProfile p = r.pool.profile();
        py::dict d;
        d["jobs"] = p.jobs;
        d["wall_s"] = p.wall_s;
        d["dispatch_s"] = p.dispatch_s;
        d["run_s"] = p.run_s;
        d["barrier_s"] = p.barrier_s;
        d["tail_s"] = p.tail_s;
        d["wake_s"] = p.wake_s;
        d["run_phase_s"] = std::vector<double>(p.run_phase_s, p.run_phase_s + kMaxProfiledPhases);
        return d;
      }, "core-seconds of the profiled jobs waited on so far, by where they went (see PoolProfile)")
      .def("wait", [](Runner& r) { py::gil_scoped_release release; r.pool.wait(); })
      .def("done", [](Runner& r) { return r.pool.done(); })
      .def("read", &Runner::read, py::arg("p"), py::arg("nbytes"), py::arg("streams") = 1,
           py::arg("chunk_bytes") = 0);
  py::class_<GatherJobs>(m, "GatherJobs")
      .def(py::init<Runner&>(), py::keep_alive<1, 2>(), py::arg("runner"))
      // experts and rows as int64 arrays (a list converts too): a prompt layer's ~1,300 pairs posted as Python lists
      // held the engine thread ~250 us more a job on the dev box (tolist, the element-wise conversion) before it began
      .def("post", [](GatherJobs& g, const Table& t, const Int64s& experts, const Int64s& rows, uint64_t x,
                      int x_fmt, int64_t x_stride, int T, uint64_t out, int out_fmt, int64_t out_stride, uint64_t flag,
                      int64_t seq) {
             g.post(t, to_vector(experts), to_vector(rows), x, x_fmt, x_stride, T, out, out_fmt, out_stride, flag,
                    seq);
           }, py::arg("table"), py::arg("experts"), py::arg("rows"), py::arg("x"),
           py::arg("x_fmt"), py::arg("x_stride"), py::arg("T"), py::arg("out"), py::arg("out_fmt"),
           py::arg("out_stride"), py::arg("flag") = 0, py::arg("seq") = 0)
      .def("wait", &GatherJobs::wait);
  py::class_<Mailbox>(m, "Mailbox")
      .def(py::init<Runner&, std::vector<Table>, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, int, uint64_t, int,
                    int, int, int, uint64_t, int, int>(),
           py::keep_alive<1, 2>(), py::arg("runner"), py::arg("tables"), py::arg("posted"), py::arg("done"),
           py::arg("meta"), py::arg("ids"), py::arg("x"), py::arg("x_fmt"), py::arg("out"), py::arg("out_fmt"),
           py::arg("H"), py::arg("KP"), py::arg("n_max"), py::arg("loc"), py::arg("E"), py::arg("spin_us") = 20000)
      .def("start", &Mailbox::start)
      .def("stop", [](Mailbox& mb) { py::gil_scoped_release release; mb.stop(); })
      .def_property_readonly("running", &Mailbox::running)
      .def("stats", [](const Mailbox& mb) {
        py::dict d;
        d["publishes"] = mb.publishes();
        d["pairs"] = mb.pairs();
        d["layers_run"] = mb.layers_run();
        d["busy_s"] = mb.busy_s();
        d["skipped"] = mb.skipped();
        return d;
      }, "publishes answered, CPU pairs and layers run, seconds spent running them, torn reads retried");
}
