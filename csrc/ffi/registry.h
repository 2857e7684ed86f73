// Registry of the XLA FFI handlers this extension exports.
//
// Each binding file registers its handlers with JK_REGISTER_FFI next to their definition, so adding an op never
// touches a shared list. module.cc hands the table to Python, which registers every entry with jax.ffi.
#pragma once

#include <vector>

namespace jk {

struct FfiTarget {
  const char* name;      // e.g. "jk_route"; the CPU twin and the CUDA version of an op share it
  const char* platform;  // "cpu" or "CUDA", as jax.ffi.register_ffi_target expects
  void* handler;         // the XLA_FFI_Handler*
};

// Function-local static: binding files register from static initialisers, whose order across files is unspecified.
std::vector<FfiTarget>& ffi_targets();

struct RegisterFfiTarget {
  RegisterFfiTarget(const char* name, const char* platform, void* handler) {
    ffi_targets().push_back({name, platform, handler});
  }
};

}  // namespace jk

#define JK_REGISTER_FFI(name, platform, handler) \
  static ::jk::RegisterFfiTarget jk_register_##handler(name, platform, reinterpret_cast<void*>(handler))
