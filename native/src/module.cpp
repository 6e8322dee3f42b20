// Python binding. Tensors cross as integer addresses, sizes, strides and a format tag: no torch here.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels.h"
#include "moe.h"
#include "pool.h"

namespace py = pybind11;
using namespace killick;

namespace {

struct IsaEntry {
  const char* name;
  const KernelTable* (*table)();
  bool (*supported)();
};

#if defined(__x86_64__) || defined(__i386__)
bool has_avx2() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }
bool has_avx512() { return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw"); }
bool has_avx512bf16() { return has_avx512() && __builtin_cpu_supports("avx512bf16"); }
#endif
bool always() { return true; }

// Best first. An ISA appears only if its translation unit was compiled (build.py defines the macros).
std::vector<IsaEntry> isa_entries() {
  std::vector<IsaEntry> out;
#ifdef KILLICK_HAVE_AVX512BF16
  out.push_back({"avx512bf16", table_avx512bf16, has_avx512bf16});
#endif
#ifdef KILLICK_HAVE_AVX512
  out.push_back({"avx512", table_avx512, has_avx512});
#endif
#ifdef KILLICK_HAVE_AVX2
  out.push_back({"avx2", table_avx2, has_avx2});
#endif
  out.push_back({"scalar", table_scalar, always});
  return out;
}

std::vector<std::string> supported_isas() {
  std::vector<std::string> out;
  for (const auto& e : isa_entries())
    if (e.supported()) out.push_back(e.name);
  return out;
}

const KernelTable* table_for(const std::string& isa) {
  for (const auto& e : isa_entries())
    if (isa == e.name && e.supported()) return e.table();
  throw std::invalid_argument("ISA '" + isa + "' is not available on this machine/build");
}

struct Runner {
  std::unique_ptr<Pool> pool_;
  Pool& pool;
  int row_block = 0;  // kernel walk order, see DotRowsFn
  int claim_rows = 64;  // rows a worker claims at a time, 1..kChunkRows (see moe.cpp)
  bool guided = true;   // claims shrink towards the end of each phase
  int prefetch_hint = 3;  // __builtin_prefetch locality of the software prefetches (3: prefetcht0)
  Runner(int threads, bool pin, int spin_us)
      : pool_(std::make_unique<Pool>(threads, pin, spin_us)), pool(*pool_) {}

  // Tasks as addresses: (gate_up, down, token, weight) per task.
  void submit_moe(const std::string& isa, int fmt, int H, int I, int64_t ld_gu, int64_t ld_dn,
                  const std::vector<uint64_t>& gate_up, const std::vector<uint64_t>& down,
                  const std::vector<int64_t>& tokens, const std::vector<float>& weights, uint64_t x,
                  int64_t x_stride, uint64_t y, int64_t y_stride, int T, int prefetch_bytes) {
    MoeArgs a = args(isa, fmt, H, I, ld_gu, ld_dn, x, x_stride, y, y_stride, T, prefetch_bytes);
    check_tokens(tokens, T);
    start(a, group_tasks(gate_up, down, tokens, weights));
  }

  // Tasks as expert ids into one layer's table: expert e's gate_up at gu_base + e * gu_estride elements.
  void submit_table(const std::string& isa, int fmt, int H, int I, uint64_t gu_base, int64_t gu_estride,
                    int64_t ld_gu, uint64_t dn_base, int64_t dn_estride, int64_t ld_dn, int64_t E,
                    const std::vector<int64_t>& experts, const std::vector<int64_t>& tokens,
                    const std::vector<float>& weights, uint64_t x, int64_t x_stride, uint64_t y,
                    int64_t y_stride, int T, int prefetch_bytes) {
    MoeArgs a = args(isa, fmt, H, I, ld_gu, ld_dn, x, x_stride, y, y_stride, T, prefetch_bytes);
    check_tokens(tokens, T);
    int64_t es = fmt == kBF16 ? 2 : 4;
    std::vector<uint64_t> gu(experts.size()), dn(experts.size());
    for (size_t i = 0; i < experts.size(); ++i) {
      if (experts[i] < 0 || experts[i] >= E)
        throw std::invalid_argument("expert id " + std::to_string(experts[i]) + " is outside the table's " +
                                    std::to_string(E) + " experts");
      gu[i] = gu_base + uint64_t(experts[i] * gu_estride * es);
      dn[i] = dn_base + uint64_t(experts[i] * dn_estride * es);
    }
    start(a, group_tasks(gu, dn, tokens, weights));
  }

 private:
  MoeArgs args(const std::string& isa, int fmt, int H, int I, int64_t ld_gu, int64_t ld_dn, uint64_t x,
                      int64_t x_stride, uint64_t y, int64_t y_stride, int T, int prefetch_bytes) const {
    if (fmt != kF32 && fmt != kBF16) throw std::invalid_argument("unknown weight format tag");
    return MoeArgs{table_for(isa), Format(fmt), H, I, ld_gu, ld_dn, reinterpret_cast<const float*>(x),
                   x_stride, reinterpret_cast<float*>(y), y_stride, T, prefetch_bytes, prefetch_hint, row_block,
                   claim_rows, guided};
  }
  static void check_tokens(const std::vector<int64_t>& tokens, int T) {
    for (int64_t t : tokens)
      if (t < 0 || t >= T)
        throw std::invalid_argument("token " + std::to_string(t) + " is outside x's " + std::to_string(T) +
                                    " rows");
  }
  void start(const MoeArgs& a, std::vector<ExpertGroup> groups) {
    py::gil_scoped_release release;
    pool.submit(make_moe_job(a, std::move(groups)));
  }
};

}  // namespace

PYBIND11_MODULE(_cpu_experts, m) {
  m.doc() = "killick native CPU expert kernels (SwiGLU experts on a pinned worker pool)";
  m.def("supported_isas", &supported_isas, "ISAs this machine and build can run, best first");
  m.def("physical_cpus", &physical_cpus, "one CPU id per physical core in the process's affinity mask");
  m.attr("FORMAT_F32") = int(kF32);
  m.attr("FORMAT_BF16") = int(kBF16);
  m.attr("MAX_TOKENS_PER_PASS") = kMaxTokens;
  py::class_<Runner>(m, "Runner")
      .def(py::init<int, bool, int>(), py::arg("threads"), py::arg("pin") = true, py::arg("spin_us") = 2000)
      .def_property_readonly("threads", [](Runner& r) { return r.pool.threads(); })
      .def_property_readonly("cpus", [](Runner& r) { return r.pool.cpus(); })
      .def_readwrite("row_block", &Runner::row_block)
      .def_readwrite("claim_rows", &Runner::claim_rows)
      .def_readwrite("guided", &Runner::guided)
      .def_readwrite("prefetch_hint", &Runner::prefetch_hint)
      .def("submit_moe", &Runner::submit_moe)
      .def("submit_table", &Runner::submit_table)
      .def("wait", [](Runner& r) { py::gil_scoped_release release; r.pool.wait(); })
      .def("done", [](Runner& r) { return r.pool.done(); })
      .def("read", [](Runner& r, const std::string& isa, uint64_t p, size_t nbytes, int streams) {
        if (streams != 1 && streams != 2 && streams != 4)
          throw std::invalid_argument("read streams must be 1, 2 or 4, got " + std::to_string(streams));
        const KernelTable* t = table_for(isa);
        py::gil_scoped_release release;
        return pool_read(r.pool, t, reinterpret_cast<const void*>(p), nbytes, streams);
      }, py::arg("isa"), py::arg("p"), py::arg("nbytes"), py::arg("streams") = 1);
}
