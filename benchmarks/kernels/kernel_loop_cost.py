"""Static cost of the acceptance kernel's loops, from its sm_90 machine code (no GPU needed).

Compiles `_row_stats_kernel` for an H100/H200 target with Triton's own ptxas (the PyPI wheel
ships it), disassembles it with nvdisasm, finds every loop that reads global memory and reports
its instructions per vocabulary entry: one line per loop version (strict greedy, relaxed greedy
with the rank count, and the sum-exp loop of sampled / delta rows), plus the fused accept step's
loop over chunk partials (marked "accept"; its "entries" are partials, not logits). Were the pass
bound by instruction issue rather than bandwidth, this count would move its time.

    python benchmarks/kernels/kernel_loop_cost.py --dtype bf16 --tile 1024 --vec 4 --warps 8
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from collections import Counter

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from thinkspec.sampling import rejection_triton as rt

# Pointer element types other than fp32; scalars are i32. The fused accept path is compiled in (as
# it runs), so its one-off code shows up beside the loops but is not counted as a loop.
POINTERS = {"draft_ptr": "i64", "mask_ptr": "u8", "pidx_ptr": "i32", "pcnt_ptr": "i32", "ndraft_ptr": "i64",
            "topk_ptr": "i64", "seed_ptr": "i64", "out_ptr": "i64", "nacc_ptr": "i64", "flag_ptr": "u8",
            "count_ptr": "i32"}  # fmt: skip
# Arguments the launcher sees as 16-aligned (pointers, V = 151,936, strides, CHUNK): as at run time.
ALIGNED = ("logits_ptr", "stride_lb", "stride_lr", "draft_ptr", "mask_ptr", "temp_ptr", "delta_ptr",
           "pmax_ptr", "pidx_ptr", "pcnt_ptr", "psum_ptr", "V", "CHUNK")  # fmt: skip


def disassemble(dtype: str, tile: int, vec: int, warps: int) -> str:
    sig = {}
    for p in rt._row_stats_kernel.params:
        if p.is_constexpr:
            sig[p.name] = "constexpr"
        elif p.name.endswith("_ptr"):
            sig[p.name] = "*" + (dtype if p.name == "logits_ptr" else POINTERS.get(p.name, "fp32"))
        else:
            sig[p.name] = "i32"
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in ALIGNED}
    constexprs = {"TILE": tile, "VEC": vec, "FUSE": rt.FUSE_ACCEPT, "HAS_Q": False, "K1_P2": 8}
    src = ASTSource(fn=rt._row_stats_kernel, signature=sig, constexprs=constexprs, attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
        return subprocess.run([nvdisasm, "-c", path], capture_output=True, text=True, check=True).stdout


def loops(sass: str, entry_bytes: int) -> list[dict]:
    """Every backward-branch loop that loads from global memory: size, entries read, per-entry cost."""
    lines = [line.split(";")[0] for line in sass.splitlines()]
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"\s*(\.L_x_\d+):", line))}
    found = []
    for i, line in enumerate(lines):
        m = re.search(r"BRA\s+`\((\.L_x_\d+)\)", line)
        if not (m and m.group(1) in labels and labels[m.group(1)] < i):
            continue
        body = [x for x in lines[labels[m.group(1)] : i + 1] if re.search(r"/\*[0-9a-f]{4}\*/", x)]
        nbytes = 0
        for x in body:
            op = re.search(r"LDG\S*", x)
            if op:
                width = op.group(0).split(".")[-1]
                nbytes += {"128": 16, "64": 8, "U16": 2, "S16": 2}.get(width, 4)
        if nbytes:
            ops = Counter(re.search(r"\*/\s+(?:@!?P\d\s+)?([A-Z0-9]+)", x).group(1) for x in body)
            entries = nbytes // entry_bytes
            found.append(dict(instructions=len(body), entries=entries, per_entry=len(body) / entries,
                              exp="MUFU" in ops, barrier="BAR" in ops,
                              top_ops=ops.most_common(6)))  # fmt: skip
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--tile", type=int, default=rt.STATS_TILE)
    ap.add_argument("--vec", type=int, default=rt.STATS_VEC)
    ap.add_argument("--warps", type=int, default=rt.STATS_WARPS)
    args = ap.parse_args()
    sass = disassemble(args.dtype, args.tile, args.vec, args.warps)
    print(f"{args.dtype} tile {args.tile} vec {args.vec} warps {args.warps}")
    for lp in loops(sass, 4 if args.dtype == "fp32" else 2):
        # The accept step's loop over chunk partials reduces across warps (barriers); not a stream.
        kind = "accept" if lp["barrier"] else "sum-exp" if lp["exp"] else "greedy"
        print(f"  {kind:8} loop: {lp['instructions']:4} instructions / {lp['entries']:3} entries = "
              f"{lp['per_entry']:.2f} per entry; {lp['top_ops']}")  # fmt: skip


if __name__ == "__main__":
    main()
