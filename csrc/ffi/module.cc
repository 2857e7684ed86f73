// The Python extension: hands every registered FFI handler to Python and reports what was built.
#include <string>
#include <vector>

#include "ffi/ffi_util.h"
#include "ffi/registry.h"
#include "nanobind/nanobind.h"
#include "nanobind/stl/string.h"
#include "nanobind/stl/tuple.h"
#include "nanobind/stl/vector.h"
#include "xla/ffi/api/c_api.h"

#ifdef JK_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace nb = nanobind;

namespace jk {

std::vector<FfiTarget>& ffi_targets() {
  static std::vector<FfiTarget> targets;
  return targets;
}

namespace {

nb::list targets_for_python() {
  nb::list out;
  for (const FfiTarget& target : ffi_targets()) {
    out.append(nb::make_tuple(target.name, target.platform, nb::capsule(target.handler)));
  }
  return out;
}

nb::dict build_info() {
  nb::dict info;
  info["version"] = JK_VERSION;
  info["xla_ffi_api"] = std::to_string(XLA_FFI_API_MAJOR) + "." + std::to_string(XLA_FFI_API_MINOR);
  info["poison_outputs"] = poison_outputs_enabled();
#ifdef JK_WITH_CUDA
  info["cuda"] = true;
  info["cuda_toolkit"] = JK_CUDA_VERSION;
  info["cuda_archs"] = std::vector<std::string>{JK_CUDA_ARCHS};
  int runtime_version = 0;
  info["cuda_runtime"] = cudaRuntimeGetVersion(&runtime_version) == cudaSuccess ? runtime_version : -1;
#else
  info["cuda"] = false;
  info["cuda_archs"] = std::vector<std::string>{};
#endif
#ifdef JK_WITH_NVSHMEM
  info["nvshmem"] = true;
#else
  info["nvshmem"] = false;
#endif
  return info;
}

}  // namespace
}  // namespace jk

NB_MODULE(_jax_kittens, m) {
  m.doc() = "jax_kittens FFI handlers";
  m.def("ffi_targets", &jk::targets_for_python, "[(target name, platform, handler capsule)] of every built handler");
  m.def("build_info", &jk::build_info, "What this extension was built with");
}
