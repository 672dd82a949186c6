"""Every Triton kernel compiles to H100/H200 machine code (sm_90), on a machine without a GPU.

The interpreter tests check what the kernels compute; this checks that the real compiler accepts
them at the launch shapes the engine uses (Triton's wheel carries ptxas), so a kernel that only
the GPU compiler rejects fails here, in CI, instead of on the device.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import pytest

triton = pytest.importorskip("triton")

import triton.language as tl  # noqa: E402
from triton import compile as triton_compile  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from thinkspec.layers import attention_triton as at  # noqa: E402
from thinkspec.layers import fused_triton as ft  # noqa: E402
from thinkspec.layers import gemm_skinny_triton as gs  # noqa: E402
from thinkspec.layers import gemv_triton as gt  # noqa: E402
from thinkspec.sampling import argmax_triton as amt  # noqa: E402
from thinkspec.sampling import rejection_triton as rt  # noqa: E402

SM90 = GPUTarget("cuda", 90, 32)
FLOATS = {"eps", "qk_scale"}  # scalar float arguments; other scalars are int32
ALIGNED = {"stride_lb", "stride_lr", "V", "CHUNK"}  # multiples of 16 at the engine's shapes


def compile_sm90(
    kernel,
    pointers: dict[str, str],
    constexprs: dict,
    num_warps: int,
    aligned: tuple[str, ...] = (),
    **options,
):
    """Compile `kernel` for sm_90 with these pointer element types (name -> "bf16", "i64", ...);
    `aligned` names more scalars that are multiples of 16 at the launch shapes of interest."""
    signature = {}
    for p in kernel.params:
        if p.is_constexpr:
            signature[p.name] = "constexpr"
        elif p.name.endswith("_ptr"):  # a pointer, or a tensor descriptor ("tensordesc<bf16[64,128]>")
            kind = pointers[p.name]
            signature[p.name] = kind if kind.startswith("tensordesc") else "*" + kind
        else:
            signature[p.name] = "fp32" if p.name in FLOATS else "i32"
    # As at run time, where Triton specialises on it: pointers and these scalars are 16-aligned.
    divisible = [
        i
        for i, (name, kind) in enumerate(signature.items())
        if (name.endswith("_ptr") and kind.startswith("*")) or name in ALIGNED or name in aligned
    ]
    attrs = {(i,): [["tt.divisibility", 16]] for i in divisible}
    constexprs = {"PDL": False, **constexprs} if "PDL" in signature else constexprs
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    launch = {"launch_pdl": True} if constexprs.get("PDL") else {}
    compiled = triton_compile(src, target=SM90, options={"num_warps": num_warps, **launch, **options})
    assert compiled.asm["cubin"], kernel.fn.__name__
    # PDL launches wait for the kernel before them first, and release the next one after that
    ptx = compiled.asm["ptx"]
    has_wait = "griddepcontrol.wait" in ptx
    assert has_wait == bool(constexprs.get("PDL")), (kernel.fn.__name__, has_wait)
    if has_wait:
        assert "griddepcontrol.launch_dependents" in ptx
        assert ptx.index("griddepcontrol.wait") < ptx.index("griddepcontrol.launch_dependents")
        before_wait = ptx[: ptx.index("griddepcontrol.wait")]
        # pdl.PREFETCH kernels read inputs no kernel of the forward writes before the wait, and ask for
        # lines in L2; nothing may be stored before it
        reads = "" if constexprs.get("PREFETCH") or constexprs.get("PREFETCH_LINES") else "ld|"
        memory = re.search(rf"\b({reads}st|atom|red|cp\.async)\.global", before_wait)
        assert not memory, f"{kernel.fn.__name__}: memory access before the wait"
        if constexprs.get("PREFETCH_LINES"):
            assert "prefetch.global.L2" in before_wait, "no L2 prefetch before the wait"
    return compiled


def _global_loads(ptx: str) -> list[str]:
    """The global-memory load instructions in a stretch of PTX, sorted ("ld.global.b32", ...)."""
    return sorted(re.findall(r"\bld\.global[\w.]*", ptx))


def resource_usage(cubin: bytes) -> dict[str, int]:
    """cuobjdump's resource line of a one-kernel cubin: {"REG": 40, "STACK": 0, "LOCAL": 0, ...}."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        out = subprocess.run(
            [tool, "--dump-resource-usage", path], capture_output=True, text=True, check=True
        )
    return {k: int(v) for k, v in re.findall(r"([A-Z]+):(\d+)", out.stdout)}


def _all(dtype: str, *names: str) -> dict[str, str]:
    return dict.fromkeys(names, dtype)


@pytest.mark.parametrize(("pdl", "prefetch"), [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_compiles(dtype, residual, pdl, prefetch):
    # prefetch (pdl.PREFETCH): the norm's weight is read before the wait, as many loads as the build
    # without prefetch makes of it after its wait (x and the residual wait), nothing stored
    ptrs = _all(dtype, "x_ptr", "res_ptr", "out_ptr", "res_out_ptr", "w_ptr")
    constexprs = {"HAS_RESIDUAL": residual, "BLOCK": 4096, "PREFETCH": prefetch, "PDL": pdl}
    kernel = compile_sm90(ft._rms_norm_kernel, ptrs, constexprs, 8, **ft.FP_COMPILE)
    if prefetch:
        twin = compile_sm90(ft._rms_norm_kernel, ptrs, {**constexprs, "PREFETCH": False}, 8, **ft.FP_COMPILE)
        ptx, twin_ptx = kernel.asm["ptx"], twin.asm["ptx"]
        before = _global_loads(ptx[: ptx.index("griddepcontrol.wait")])
        loads = _global_loads(twin_ptx)  # x's, the residual's and the weight's, alike in width
        assert _global_loads(ptx) == loads and before
        assert len(before) * (3 if residual else 2) == len(loads)  # the weight's alone


@pytest.mark.parametrize(
    ("store_kv", "pdl", "prefetch"),
    [(False, False, False), (True, False, False), (True, True, False), (True, True, True)],
)
@pytest.mark.parametrize("block_h", [1, 4])
@pytest.mark.parametrize("has_norm", [False, True])
def test_qk_norm_rope_compiles(block_h, has_norm, store_kv, pdl, prefetch):
    # prefetch (pdl.PREFETCH): the position, slot, rotary row and norm weights are read before the
    # wait, nothing stored
    ptrs = _all("bf16", "q_ptr", "k_ptr", "q_out_ptr", "k_out_ptr", "q_w_ptr", "k_w_ptr", "v_ptr")
    ptrs.update(_all("bf16", "k_cache_ptr", "v_cache_ptr"), pos_ptr="i64", cache_ptr="fp32", slot_ptr="i64")
    constexprs = {
        "HAS_NORM": has_norm, "HEAD_DIM": 128, "BLOCK_H": block_h, "BLOCK_HALF": 64, "STORE_KV": store_kv,
        "PREFETCH": prefetch, "PDL": pdl,
    }  # fmt: skip
    warps = min(max(block_h * 64 // 128, 1), 4)
    kernel = compile_sm90(ft._qk_norm_rope_kernel, ptrs, constexprs, warps, **ft.FP_COMPILE)
    if prefetch:
        # what it reads before the wait is what the build without prefetch reads between its wait and
        # its release (the position, the slot, the rotary row and the norm weights), no activation
        twin = compile_sm90(
            ft._qk_norm_rope_kernel, ptrs, {**constexprs, "PREFETCH": False}, warps, **ft.FP_COMPILE
        )
        ptx, twin_ptx = kernel.asm["ptx"], twin.asm["ptx"]
        wait, release = "griddepcontrol.wait", "griddepcontrol.launch_dependents"
        before = _global_loads(ptx[: ptx.index(wait)])
        assert before and before == _global_loads(twin_ptx[twin_ptx.index(wait) : twin_ptx.index(release)])


@pytest.mark.parametrize("pdl", [False, True])
def test_greedy_argmax_compiles_without_spills(pdl):
    # Qwen3's vocabulary: 38 chunks per row, merged by the last program
    ptrs = {"x_ptr": "fp32", "out_ptr": "i64", "pval_ptr": "fp32", "pidx_ptr": "i32", "count_ptr": "i32"}
    constexprs = {"BLOCK": amt.BLOCK, "NC_P2": 64, "PDL": pdl}
    kernel = compile_sm90(amt._argmax_kernel, ptrs, constexprs, amt.NUM_WARPS)
    assert resource_usage(kernel.asm["cubin"])["STACK"] == 0


@pytest.mark.parametrize("pdl", [False, True])
def test_silu_and_mul_compiles(pdl):
    ptrs = _all("bf16", "x_ptr", "out_ptr")
    compile_sm90(ft._silu_and_mul_kernel, ptrs, {"BLOCK": 1024, "PDL": pdl}, 4, **ft.FP_COMPILE)


@pytest.mark.parametrize("pdl", [False, True])
def test_store_kv_compiles(pdl):
    ptrs = _all("bf16", "k_ptr", "v_ptr", "k_cache_ptr", "v_cache_ptr")
    ptrs["slot_ptr"] = "i64"
    compile_sm90(at._store_kv_kernel, ptrs, {"HEAD_DIM": 128, "BLOCK_H": 8, "BLOCK_D": 128, "PDL": pdl}, 4)


# The attention kernel's strides are multiples of 16 at the engine's shapes (head_dim 128; q a view of the
# q/k/v product), and Triton specialises such ints at launch: compiled so here too, as the engine runs it.
ATTENTION_STRIDES = (
    "stride_qt", "stride_qh", "stride_cb", "stride_cs", "stride_ch", "stride_ot", "stride_oh", "stride_os",
    "stride_ft", "stride_fh",
)  # fmt: skip


def _attention_pointers(dtype: str, splits: int) -> dict[str, str]:
    ptrs = _all(dtype, "q_ptr", "k_cache_ptr", "v_cache_ptr", "final_ptr")
    ptrs.update(block_tables_ptr="i32", query_start_ptr="i32", seq_lens_ptr="i32")
    ptrs.update(ml_ptr="fp32", sem_ptr="i32")
    ptrs["out_ptr"] = "fp32" if splits > 1 else dtype
    return ptrs


@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize(
    ("dtype", "splits", "block_q", "fused"),
    [("bf16", 1, 4, False), ("bf16", 16, 4, True), ("bf16", 16, 4, False), ("bf16", 64, 4, True),
     ("bf16", 1, 16, False), ("fp32", 4, 4, True), ("fp32", 4, 4, False)],
)  # fmt: skip
def test_paged_attention_compiles(dtype, splits, block_q, fused, pdl):
    # block_q 4: decode / verify rows (GROUP 4 pads to 16 rows); 16: prefill chunks (64 rows);
    # fused: the last split program merges (gpu-scope acq_rel atomic after a block barrier); with PDL
    # the engine's CUDA launch: the first tile's cached K/V asked for in L2 before the wait
    line = 32 if dtype == "fp32" else 64
    constexprs = {
        "HEAD_DIM": 128, "BLOCK_SIZE": 16, "GROUP": 4, "GROUP_PAD": 4, "BLOCK_Q": block_q, "BLOCK_N": 64,
        "BLOCK_D": 128, "NUM_SPLITS": splits, "FUSE_COMBINE": fused, "FP32_DOT": dtype == "fp32",
        "PREFETCH_LINES": 128 // line if pdl else 0, "LINE": line, "PDL": pdl,
    }  # fmt: skip
    kernel = compile_sm90(at._paged_attn_kernel, _attention_pointers(dtype, splits), constexprs, 4)
    if fused:
        ptx = kernel.asm["ptx"]
        assert re.search(r"atom\.global\.(gpu\.)?acq_rel|atom\.acq_rel\.gpu", ptx), "no acq_rel atomic"
        assert "bar.sync" in ptx or "barrier.sync" in ptx
    if splits > 1 and not fused:
        ptrs = {"acc_ptr": "fp32", "ml_ptr": "fp32", "out_ptr": dtype, "query_start_ptr": "i32"}
        constexprs = {"HEAD_DIM": 128, "NUM_SPLITS": splits, "BLOCK_D": 128, "PDL": pdl}
        compile_sm90(at._combine_kernel, ptrs, constexprs, 4)


@pytest.mark.parametrize(
    ("group", "block_q", "block_n", "splits"),
    [(4, 4, 64, 1), (4, 4, 64, 8), (2, 8, 64, 8), (4, 8, 64, 4), (4, 4, 128, 1), (4, 4, 128, 2),
     (4, 8, 128, 1), (4, 8, 128, 4)],
)  # fmt: skip
def test_paged_attention_copies_kv_tiles_16_bytes_at_a_time(group, block_q, block_n, splits):
    # bf16 decode (16 rows: Qwen3-8B's 4 query heads per KV head, the 0.6B's 2) and verify tiles (32 rows),
    # 64- and 128-key tiles, unsplit and split (merged in-kernel), with PDL and the L2 prefetch, compiled
    # as launched: the K/V tiles go to shared memory in 16-byte asynchronous copies, no scalar 2-byte
    # loads, no spills, shared memory fits. With the strides left unspecialised (do_not_specialize) the
    # same kernel loads K and V two bytes at a time into registers (Triton 3.9: 255 registers and a
    # 24-byte stack for the 64-key decode tile).
    constexprs = {
        "HEAD_DIM": 128, "BLOCK_SIZE": 16, "GROUP": group, "GROUP_PAD": group, "BLOCK_Q": block_q,
        "BLOCK_N": block_n, "BLOCK_D": 128, "NUM_SPLITS": splits, "FUSE_COMBINE": splits > 1,
        "FP32_DOT": False, "PREFETCH_LINES": 2, "LINE": 64, "PDL": True,
    }  # fmt: skip
    assert not {p.name for p in at._paged_attn_kernel.params if p.do_not_specialize} & set(ATTENTION_STRIDES)
    ptrs = _attention_pointers("bf16", splits)
    kernel = compile_sm90(at._paged_attn_kernel, ptrs, constexprs, 4, ATTENTION_STRIDES, num_stages=3)
    ptx = kernel.asm["ptx"]
    assert re.search(r"cp\.async\.cg\.shared\.global[^;]*, 0x10,", ptx), "K/V not copied 16 bytes at a time"
    assert "ld.global.b16" not in _global_loads(ptx)
    usage = resource_usage(kernel.asm["cubin"])
    assert usage["LOCAL"] == 0 and usage["STACK"] == 0, usage
    assert kernel.metadata.shared <= 227 * 1024, kernel.metadata.shared


@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize(
    ("rows", "n", "k", "glu"),
    [(r, 4096, k, False) for r in (1, 2, 4) for k in (4096, 12288, 1000)]
    + [(r, 1024, k, False) for r in (1, 2) for k in (2048, 3072)]
    + [(r, 4096, k, True) for r in (1, 2) for k in (1024, 1000)],
)
def test_gemv_compiles_without_spills(rows, n, k, glu, pdl):
    # the engine's launch shapes (gemv_config) at Qwen3-8B / 0.6B widths; 1000: the masked-K path;
    # n = 1024: the 0.6B's o and down (wider K tiles); glu: the gate/up product with SiLU(gate) * up
    # in the epilogue (two accumulators)
    block_n, block_k, warps, stages = gt.gemv_config(rows, n, k, glu)
    constexprs = {
        "HAS_BIAS": rows == 2, "GLU": glu, "BLOCK_M": triton.next_power_of_2(rows), "BLOCK_N": block_n,
        "BLOCK_K": block_k, "EVEN_K": k % block_k == 0, "PDL": pdl,
    }  # fmt: skip
    ptrs = _all("bf16", "x_ptr", "w_ptr", "b_ptr", "y_ptr")
    kernel = compile_sm90(gt._gemv_kernel, ptrs, constexprs, warps, num_stages=stages)
    usage = resource_usage(kernel.asm["cubin"])
    assert usage["LOCAL"] == 0 and usage["STACK"] == 0, usage


@pytest.mark.parametrize("rows", [3, 16, 17, 64])
@pytest.mark.parametrize(
    "config",
    [
        None,
        (32, 64, 1, 4, 3),
        (64, 128, 2, 4, 4),
        (128, 128, 1, 8, 4),
        (64, 256, 1, 8, 3),
        (128, 64, 1, 4, 5),
    ],
)
@pytest.mark.parametrize("pdl", [False, True])
def test_skinny_gemm_compiles_pipelined_without_spills(rows, config, pdl):
    # Qwen3-8B's o_proj (4096 x 4096), whose strides and K are multiples of 16 as at run time: the
    # weight tiles must stream through cp.async stages (the kernel's point), with no spills, and fit
    # the H200's 227 KiB of shared memory (the GLU epilogue: test_skinny_gemm_table_entries_compile)
    n = k = 4096
    block_n, block_k, split, warps, stages = config or gs.skinny_gemm_config(rows, n, k)
    for split_out in {False, split > 1}:
        constexprs = {
            "HAS_BIAS": not split_out, "SPLIT": split_out, "GLU": False,
            "BLOCK_M": max(16, triton.next_power_of_2(rows)), "BLOCK_N": block_n, "BLOCK_K": block_k,
            "EVEN_K": True, "DOT_F32": False, "PDL": pdl, "TMA": False, "X_DTYPE": tl.bfloat16,
        }  # fmt: skip
        ptrs = _all("bf16", "x_ptr", "w_ptr", "b_ptr", "y_ptr")
        ptrs["y_ptr"] = "fp32" if split_out else "bf16"
        aligned = ("stride_x", "stride_w", "stride_y", "stride_ys", "N", "K", "K_PER_SPLIT")
        kernel = compile_sm90(gs._skinny_gemm_kernel, ptrs, constexprs, warps, aligned, num_stages=stages)
        usage = resource_usage(kernel.asm["cubin"])
        assert usage["LOCAL"] == 0 and usage["STACK"] == 0, usage
        assert "async_copy_global_to_local" in kernel.asm["ttgir"], "the weight loads are not pipelined"
        assert kernel.metadata.shared <= 227 * 1024, kernel.metadata.shared
    ptrs = {"part_ptr": "fp32", "b_ptr": "bf16", "y_ptr": "bf16"}
    constexprs = {"SPLIT_K": 4, "HAS_BIAS": True, "BLOCK": 1024, "PDL": pdl}
    compile_sm90(gs._split_k_sum_kernel, ptrs, constexprs, 4)


@pytest.mark.parametrize(("pdl", "prefetch"), [(False, False), (True, False), (True, True)])
def test_split_k_sum_rms_norm_compiles(pdl, prefetch):
    # the sum of o / down's partials with the norm after it (4096 columns, 8 warps, as rms_norm's);
    # prefetch: only the norm's weight is read before the wait, as in the RMSNorm kernel
    ptrs = {"part_ptr": "fp32", **_all("bf16", "b_ptr", "res_ptr", "out_ptr", "res_out_ptr", "w_ptr")}
    constexprs = {"SPLIT_K": 2, "HAS_BIAS": False, "BLOCK": 4096, "PREFETCH": prefetch, "PDL": pdl}
    aligned = ("stride_res", "MN", "N")
    kernel = compile_sm90(gs._split_k_sum_rms_norm_kernel, ptrs, constexprs, 8, aligned, **ft.FP_COMPILE)
    usage = resource_usage(kernel.asm["cubin"])
    assert usage["LOCAL"] == 0 and usage["STACK"] == 0, usage
    if prefetch:
        twin_constexprs = {**constexprs, "PREFETCH": False}
        kernel_fn = gs._split_k_sum_rms_norm_kernel
        twin = compile_sm90(kernel_fn, ptrs, twin_constexprs, 8, aligned, **ft.FP_COMPILE)
        ptx, twin_ptx = kernel.asm["ptx"], twin.asm["ptx"]
        before = _global_loads(ptx[: ptx.index("griddepcontrol.wait")])
        after = _global_loads(twin_ptx[twin_ptx.index("griddepcontrol.wait") :])
        assert _global_loads(ptx) == _global_loads(twin_ptx) and before
        # after the wait without prefetch: the two float32 partial rows (twice a bf16 row's loads each),
        # the residual and the weight; with prefetch the weight's alone come before it
        assert len(after) == (2 * 2 + 2) * len(before)


def _compile_skinny(
    block_m: int, config: tuple[int, ...], glu: bool, tma: bool, even_k: bool = True, fp32_out: bool = False
):
    """The skinny GEMM built for sm_90 at launch shape `config` over block_m-row tiles, with pointer loads
    or tensor descriptors (tma); its output float32 where K is split (partials) or with fp32_out."""
    block_n, block_k, split, warps, stages = config
    constexprs = {
        "HAS_BIAS": False, "SPLIT": split > 1, "GLU": glu, "BLOCK_M": block_m, "BLOCK_N": block_n,
        "BLOCK_K": block_k, "EVEN_K": even_k, "DOT_F32": False, "PDL": True, "TMA": tma,
        "X_DTYPE": tl.bfloat16,
    }  # fmt: skip
    ptrs = _all("bf16", "x_ptr", "w_ptr", "b_ptr", "y_ptr")
    if tma:
        ptrs["x_ptr"] = f"tensordesc<bf16[{block_m},{block_k}]>"
        ptrs["w_ptr"] = f"tensordesc<bf16[{block_n},{block_k}]>"
    ptrs["y_ptr"] = "fp32" if split > 1 or fp32_out else "bf16"
    aligned = ("stride_x", "stride_w", "stride_y", "stride_ys", "N", "K", "K_PER_SPLIT")
    return compile_sm90(gs._skinny_gemm_kernel, ptrs, constexprs, warps, aligned, num_stages=stages)


def _skinny_table_builds() -> list:
    """One case per distinct sm_90 build the tables' entries launch, (glu, block_m, config, even_k,
    fp32_out): entries (rows, n, k) that share a build would compile and check the same kernel."""
    builds: dict[tuple, list[str]] = {}
    for glu, table in ((False, gs.SKINNY_GEMM_TABLE), (True, gs.SKINNY_GLU_TABLE)):
        for (rows, n, k), config in table.items():
            build = (glu, max(16, rows), config, k % config[1] == 0, n == 151936)
            builds.setdefault(build, []).append(f"{rows}x{n}x{k}")
    return [pytest.param(*b, id=("glu-" if b[0] else "") + "-".join(keys)) for b, keys in builds.items()]


@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize(("glu", "block_m", "config", "even_k", "fp32_out"), _skinny_table_builds())
def test_skinny_gemm_table_entries_compile(glu, block_m, config, even_k, fp32_out, tma):
    # every launch shape the tables send an engine product to, with pointer loads and with tensor
    # descriptors (TMA): pipelined, no spills, fits shared memory (the lm_head's logits in float32)
    split, stages = config[2], config[4]
    assert not glu or split == 1
    kernel = _compile_skinny(block_m, config, glu, tma, even_k=even_k, fp32_out=fp32_out)
    usage = resource_usage(kernel.asm["cubin"])
    assert usage["LOCAL"] == 0 and usage["STACK"] == 0, usage
    if tma:  # the tiles come through the copy engine, several in flight
        assert "async_copy_global_to_local" not in kernel.asm["ttgir"]
        loads = kernel.asm["ptx"].count("cp.async.bulk.tensor")
        assert loads >= 2 * (stages - 1), f"the tile loads are not pipelined ({loads} copy instructions)"
    else:
        assert "async_copy_global_to_local" in kernel.asm["ttgir"]
    assert kernel.metadata.shared <= 227 * 1024, kernel.metadata.shared


def _gpu_case_shapes() -> list[tuple[int, tuple[int, int, int, int, int], bool]]:
    from test_gemm_skinny_triton import GPU_GLU_SHAPES, GPU_NORM_ROWS, GPU_NORM_SHAPES, GPU_ROWS, GPU_SHAPES

    cases = {(rows, config, False) for rows in GPU_ROWS for config in GPU_SHAPES}
    cases |= {(rows, config, True) for rows in GPU_ROWS for config in GPU_GLU_SHAPES}
    cases |= {(rows, config, False) for rows in GPU_NORM_ROWS for config in GPU_NORM_SHAPES}
    return sorted(cases)


@pytest.mark.parametrize(("rows", "config", "glu"), _gpu_case_shapes())
def test_skinny_gemm_gpu_case_shapes_fit_shared_memory(rows, config, glu):
    # the launch shapes the skinny GEMM's GPU cases fix, at the row counts they run (the row tile is
    # the next power of two): one past the H200's 227 KiB cannot launch there, which fails the case
    # without saying why (a 128-row tile needs 240 KiB at (64, 128, 2, 4, 5), 160 at 64 rows)
    for tma in (False, True):
        kernel = _compile_skinny(max(16, triton.next_power_of_2(rows)), config, glu, tma)
        assert kernel.metadata.shared <= 227 * 1024, (rows, config, tma, kernel.metadata.shared)


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_acceptance_kernels_compile(dtype):
    accept = {
        "logits_ptr": dtype, "draft_ptr": "i64", "mask_ptr": "u8", "temp_ptr": "fp32", "delta_ptr": "fp32",
        "pmax_ptr": "fp32", "pidx_ptr": "i32", "pcnt_ptr": "i32", "psum_ptr": "fp32", "ndraft_ptr": "i64",
        "ratio_ptr": "fp32", "topk_ptr": "i64", "q_ptr": "fp32", "seed_ptr": "i64", "out_ptr": "i64",
        "nacc_ptr": "i64", "flag_ptr": "u8", "emit_lse_ptr": "fp32",
        # the lenient / typical rules' inputs (read when RULES) and the stats' sum of exp(x - m) * x
        "psx_ptr": "fp32", "rule_ptr": "i64", "lam_ptr": "fp32", "eps_ptr": "fp32", "alpha_ptr": "fp32",
    }  # fmt: skip
    tile, vec = rt.STATS_TILE, rt.STATS_VEC
    variants = ((False, False, False), (True, False, False), (True, True, False), (True, True, True))
    for fuse, has_q, rules in variants:  # (FUSE, HAS_Q, RULES)
        constexprs = {"TILE": tile, "VEC": vec, "FUSE": fuse, "HAS_Q": has_q, "K1_P2": 8, "RULES": rules}
        stats = compile_sm90(
            rt._row_stats_kernel, {**accept, "count_ptr": "i32"}, constexprs, rt.STATS_WARPS,
            maxnreg=rt.STATS_MAXNREG,
        )  # fmt: skip
        # The grid assumes the register cap; under it at most a value or two may spill (once, in
        # the accept tail), never the streaming loops' state.
        usage = resource_usage(stats.asm["cubin"])
        assert usage["REG"] <= rt.STATS_MAXNREG and usage["LOCAL"] == 0 and usage["STACK"] <= 16, usage
    for has_q, rules in ((False, False), (True, False), (True, True)):
        compile_sm90(rt._accept_kernel, accept, {"HAS_Q": has_q, "K1_P2": 8, "RULES": rules}, 2)
    race = {
        "logits_ptr": dtype, "draft_ptr": "i64", "ndraft_ptr": "i64", "temp_ptr": "fp32", "q_ptr": "fp32",
        "seed_ptr": "i64", "nacc_ptr": "i64", "emit_lse_ptr": "fp32", "rbest_ptr": "fp32", "ridx_ptr": "i32",
        "pbest_ptr": "fp32", "pidx_ptr": "i32", "out_ptr": "i64",
    }  # fmt: skip
    compile_sm90(rt._race_kernel, race, {"HAS_Q": True, "TILE": rt.MAX_TILE}, rt.NUM_WARPS)
    compile_sm90(rt._race_reduce_kernel, race, {"NC_P2": 32}, 1)
