"""The consumers' k loop of every grouped-GEMM kernel, read from compiled SASS: a check to run before a device A/B.

The consumers' k loop is the kernels' hot path (four wgmma a k step per warpgroup). ptxas keeps its stage counter
and wgmma descriptors in uniform registers only while the rest of the kernel leaves it room: a change elsewhere can
demote them to vector registers, and every k step then pays R2UR moves before each wgmma. The forty-ninth session's
whole-warp producer did so in every cluster-of-two kernel (the down GEMM's k step: 58 instructions executed became
73, measured on an H100 with ncu). The producer's own code does not show it; this does, per kernel, with no GPU:

  python3 benchmarks/kloop_sass.py build/grouped_gemm_cuda.o    # an object or shared library (through cuobjdump)
  python3 benchmarks/kloop_sass.py base.sass variant.sass       # `cuobjdump -sass` text; the later files compared

Per kernel: the consumers' k loop (`consumer_k_loop`, the landmark `gemm_counters.py --source` uses too), its
instruction count, its R2UR moves and uniform-datapath instructions, and the function's local-memory accesses
(spills). A `*` marks a loop with more R2UR moves than in the first file. cuobjdump comes from PATH or --cuobjdump
(the `nvidia-cuda-cuobjdump` wheel has one).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import shutil
import subprocess
import sys

MODES = {0: "gmm", 1: "swiglu", 2: "swiglu_dgrad", 3: "tgmm"}
GATHERED = {0: "none", 1: "lhs", 2: "rhs"}
# grouped_gemm_kernel<Mode, kBMnMajor, OutT, kCluster, Gathered>, as Itanium-mangled template arguments.
KERNEL = re.compile(r"grouped_gemm_kernelILNS1_4ModeE(\d)ELb(\d)E(\w)Li(\d)ELNS1_8GatheredE(\d)E")
INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


@dataclasses.dataclass
class KLoop:
  instructions: int
  r2ur: int
  uniform: int
  local_memory: int  # in the whole function


def kernel_label(name: str) -> str | None:
  match = KERNEL.search(name)
  if not match:
    return None
  mode, mn_major, out, cluster, gathered = match.groups()
  out_type = {"t": "bf16", "f": "f32"}.get(out, out)
  return (f"{MODES[int(mode)]:<12} rhs {'mn' if mn_major == '1' else 'k '}-major out {out_type:<4} "
          f"cluster {cluster} gathered {GATHERED[int(gathered)]}")


def functions(sass: str) -> dict[str, list[tuple[int, str]]]:
  """Function name -> [(address, instruction)] of each grouped-GEMM kernel in `cuobjdump -sass` text."""
  result: dict[str, list[tuple[int, str]]] = {}
  current = None
  for line in sass.splitlines():
    header = re.match(r"\s*Function : (\S+)", line)
    if header:
      current = kernel_label(header.group(1))
      if current is not None:
        result[current] = []
      continue
    instruction = INSTRUCTION.search(line)
    if instruction and current is not None:
      result[current].append((int(instruction.group(1), 16), instruction.group(2)))
  return result


def opcode(text: str) -> str:
  """The opcode of an instruction, past its predicate (`@!P1 BRA 0x...` -> `BRA`)."""
  words = text.split()
  return words[1] if words[0].startswith("@") else words[0]


def branch_target(text: str) -> int | None:
  """The address a direct branch goes to (`@!P0 BRA 0x1010` -> 0x1010); None for other instructions."""
  if "BRA" not in text:
    return None
  target = text.split("BRA", 1)[1].split()[0]
  return int(target, 16) if target.startswith("0x") else None


def consumer_k_loop(sass: list[str], addresses: list[int], stop: int | None = None) -> tuple[int, int] | None:
  """Indices (begin, latch) of the consumers' k loop in one of our kernels' instructions in address order: from
  the target of the first branch back across the last HGMMA, through that branch (k steps unrolled ahead of the
  loop, which store the previous tile's held chunks, lie before it). Branches are looked for up to index `stop`
  (the producer's code); None without an HGMMA or such a branch."""
  hgmma = [i for i, text in enumerate(sass) if "HGMMA" in text]
  if not hgmma:
    return None
  index = {address: i for i, address in enumerate(addresses)}
  for latch in range(hgmma[-1], len(sass) if stop is None else stop):
    target = branch_target(sass[latch])
    if target is not None and index.get(target, len(sass)) < hgmma[-1]:
      return index[target], latch
  return None


def k_loop(code: list[tuple[int, str]]) -> KLoop | None:
  """The consumers' k loop of one kernel, code: [(address, instruction)] in address order."""
  sass = [text for _, text in code]
  loop = consumer_k_loop(sass, [address for address, _ in code])
  if loop is None:
    return None
  body = [opcode(text) for text in sass[loop[0]:loop[1] + 1]]
  return KLoop(
    instructions=len(body),
    r2ur=sum(op.startswith("R2UR") for op in body),
    uniform=sum(op.startswith("U") and not op.startswith("UTMA") for op in body),
    local_memory=sum(opcode(text).startswith(("LDL", "STL")) for text in sass),
  )


def read_sass(path: str, cuobjdump: str) -> str:
  """`cuobjdump -sass` text of an object or library, or a saved one (.sass)."""
  if path.endswith(".sass"):
    with open(path) as f:
      return f.read()
  return subprocess.run([cuobjdump, "-sass", path], check=True, capture_output=True, text=True).stdout


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("files", nargs="+", help="objects, shared libraries or cuobjdump -sass text (.sass)")
  parser.add_argument("--cuobjdump", default=shutil.which("cuobjdump") or "cuobjdump")
  args = parser.parse_args(argv)
  tables = [{name: k_loop(code) for name, code in functions(read_sass(f, args.cuobjdump)).items()} for f in args.files]
  if not tables[0]:
    print(f"kloop_sass: no grouped_gemm_kernel in {args.files[0]}", file=sys.stderr)
    return 1
  print(f"{'kernel':<60}" + "".join(f" | {f[-28:]:>28}" for f in args.files))
  print(f"{'':<60}" + " | instrs R2UR uniform local" * len(args.files))
  demoted = False
  for name in tables[0]:
    cells = []
    base = tables[0][name]
    for table in tables:
      loop = table.get(name)
      if loop is None:
        cells.append("(no k loop)")
        continue
      # A few R2UR either way is ptxas's noise; a demoted loop gains one or more a wgmma.
      flag = "*" if base is not None and loop.r2ur > base.r2ur + 2 else " "
      demoted |= flag == "*"
      cells.append(f"{loop.instructions:>6} {loop.r2ur:>4}{flag}{loop.uniform:>6} {loop.local_memory:>5}")
    print(f"{name:<60}" + "".join(f" | {c:>28}" for c in cells))
  if demoted:
    print("kloop_sass: * a k loop with more R2UR moves than in the first file: its uniform registers demoted")
  return 0


if __name__ == "__main__":
  sys.exit(main())
