"""The sm90 grouped-GEMM kernels as ptxas builds them, checked without a GPU (nvcc and the CUTLASS headers only).

- No kernel has its wgmma serialized (ptxas C7515). ptxas does that with no more than an info line when a non-wgmma
  instruction defines accumulator registers inside the wgmma pipeline: every HGMMA then waits for the one before
  it. Zeroing the accumulators of padding rows in the epilogue did that to all 28 kernels (twenty-seventh session).
- No kernel spills more than 64 bytes: what the gathered kernels' producers (40 registers each) spill now. Spills of
  the consumers' registers (2.3 KB once, from a deadline loop) show up here before they show up on a GPU.
Skipped where nvcc or the nvidia-cutlass wheel is missing.
"""

import pathlib
import re
import shutil
import subprocess

import jax.ffi
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
MAX_SPILL_BYTES = 64
KERNELS = 28  # grouped_gemm_kernel instances: every mode, operand major, output type, cluster size, gathered operand


def _cutlass_include():
  try:
    import cutlass_library  # noqa: PLC0415 (optional: the nvidia-cutlass wheel)
  except ImportError:
    return None
  include = pathlib.Path(cutlass_library.__file__).parent / "source" / "include"
  return include if (include / "cute" / "tensor.hpp").exists() else None


@pytest.fixture(scope="module")
def ptxas_log(tmp_path_factory):
  """ptxas -v output of csrc/ffi/grouped_gemm_cuda.cu, compiled with the build's CUDA flags (CMakeLists.txt)."""
  nvcc, include = shutil.which("nvcc"), _cutlass_include()
  if nvcc is None or include is None:
    pytest.skip("needs nvcc and the nvidia-cutlass wheel")
  command = [nvcc, "-std=c++17", "-O3", "-gencode=arch=compute_90a,code=sm_90a", "--expt-relaxed-constexpr",
             "--expt-extended-lambda", "-DJK_WITH_CUDA", "-Xptxas=-v", f"-I{ROOT / 'csrc'}",
             f"-I{jax.ffi.include_dir()}", f"-I{include}", "-c", str(ROOT / "csrc" / "ffi" / "grouped_gemm_cuda.cu"),
             "-o", str(tmp_path_factory.mktemp("ptxas") / "grouped_gemm.o")]
  result = subprocess.run(command, capture_output=True, text=True, timeout=1800, check=False)
  assert result.returncode == 0, result.stderr[-4000:]
  return result.stdout + result.stderr


def grouped_gemm_spills(log: str) -> dict[str, int]:
  """{mangled kernel name: spill store bytes} of every grouped_gemm_kernel in a ptxas -v log."""
  spills, kernel = {}, None
  for line in log.splitlines():
    if match := re.search(r"Compiling entry function '(\w+)'", line):
      kernel = match.group(1) if "grouped_gemm_kernel" in match.group(1) else None
    elif kernel and (match := re.search(r"(\d+) bytes spill stores", line)):
      spills[kernel] = int(match.group(1))
      kernel = None
  return spills


def test_no_wgmma_is_serialized(ptxas_log):
  serialized = [line for line in ptxas_log.splitlines() if "C7515" in line]
  assert not serialized, "\n".join(serialized[:4])


def test_spills_stay_small(ptxas_log):
  spills = grouped_gemm_spills(ptxas_log)
  assert len(spills) == KERNELS
  over = {kernel: size for kernel, size in spills.items() if size > MAX_SPILL_BYTES}
  assert not over, over
