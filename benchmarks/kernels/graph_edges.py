"""A captured CUDA graph's edges, read and rewritten through the CUDA driver API (ctypes, no build).

Capture records a kernel launched with programmatic dependent launch (PDL) as a programmatic edge
from the node before it; every other dependency is a full one (the next node starts once the one
before has completed). Rewriting a full edge into a programmatic one lets the next kernel start as
soon as every program of the one before has exited (or released it early): safe only if the next
kernel waits (PTX griddepcontrol.wait) before it reads. `bench_cublas_chain.py` uses this to ask
whether cuBLAS's kernels wait, and what the boundaries between its launches cost when they overlap.

Needs a CUDA driver of 12.3 or newer (edge data, kernel names). Graphs are torch's CUDAGraph made
with keep_graph=True (bench_gemv.capture_graph(fn, keep=True)), so edges can change before
`instantiate()`.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

P = ctypes.c_void_p
KERNEL, MEMCPY, MEMSET = 0, 1, 2  # CUgraphNodeType values used here
Edge = tuple[int, int, int]  # (from_port, to_port, type) of an edge
FULL = (0, 0, 0)  # (from_port, to_port, type) of a default edge
# from port CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC, type CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC
PROGRAMMATIC = (1, 0, 1)


class _EdgeData(ctypes.Structure):  # CUgraphEdgeData
    _fields_ = [("from_port", ctypes.c_ubyte), ("to_port", ctypes.c_ubyte), ("type", ctypes.c_ubyte),
                ("reserved", ctypes.c_ubyte * 5)]  # fmt: skip


class _KernelParams(ctypes.Structure):  # CUDA_KERNEL_NODE_PARAMS_v2
    _fields_ = [("func", P), ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("smem", ctypes.c_uint), ("kernel_params", P), ("extra", P), ("kern", P),
                ("ctx", P)]  # fmt: skip


@functools.cache
def _driver() -> dict[str, Callable]:
    lib = ctypes.CDLL("libcuda.so.1")
    get = lib.cuGetProcAddress_v2
    get.argtypes = [ctypes.c_char_p, ctypes.POINTER(P), ctypes.c_int, ctypes.c_uint64,
                    ctypes.POINTER(ctypes.c_int)]  # fmt: skip
    sizes = ctypes.POINTER(ctypes.c_size_t)
    signatures = {  # entry points as of CUDA 12.3 (the versions that carry edge data)
        "cuGraphGetEdges": (P, P, P, P, sizes),
        "cuGraphAddDependencies": (P, P, P, P, ctypes.c_size_t),
        "cuGraphRemoveDependencies": (P, P, P, P, ctypes.c_size_t),
        "cuGraphNodeGetType": (P, ctypes.POINTER(ctypes.c_int)),
        "cuGraphKernelNodeGetParams": (P, ctypes.POINTER(_KernelParams)),
        "cuFuncGetName": (ctypes.POINTER(ctypes.c_char_p), P),
        "cuKernelGetName": (ctypes.POINTER(ctypes.c_char_p), P),
    }
    fns = {}
    for name, args in signatures.items():
        ptr, found = P(), ctypes.c_int()
        rc = get(name.encode(), ctypes.byref(ptr), 12030, 0, ctypes.byref(found))
        if rc != 0 or not ptr.value:
            raise RuntimeError(f"CUDA driver has no {name} (needs 12.3 or newer; cuGetProcAddress: {rc})")
        fns[name] = ctypes.CFUNCTYPE(ctypes.c_int, *args)(ptr.value)
    return fns


def _call(name: str, *args) -> None:
    rc = _driver()[name](*args)
    if rc != 0:
        raise RuntimeError(f"{name} failed with CUresult {rc}")


def edges(graph: int) -> list[tuple[int, int, Edge]]:
    """Every edge of a cudaGraph_t as (from node, to node, (from_port, to_port, type))."""
    n = ctypes.c_size_t()
    _call("cuGraphGetEdges", graph, None, None, None, ctypes.byref(n))
    a, b, d = (P * n.value)(), (P * n.value)(), (_EdgeData * n.value)()
    _call("cuGraphGetEdges", graph, a, b, d, ctypes.byref(n))
    return [(a[i], b[i], (d[i].from_port, d[i].to_port, d[i].type)) for i in range(n.value)]


def node_type(node: int) -> int:
    """A graph node's CUgraphNodeType (KERNEL, MEMCPY, MEMSET, ...)."""
    t = ctypes.c_int()
    _call("cuGraphNodeGetType", node, ctypes.byref(t))
    return t.value


def node_name(node: int) -> str:
    """A kernel node's kernel name; "<memset>", "<memcpy>" or "<type N>" for other nodes."""
    t = node_type(node)
    if t != KERNEL:
        return {MEMSET: "<memset>", MEMCPY: "<memcpy>"}.get(t, f"<type {t}>")
    params, name = _KernelParams(), ctypes.c_char_p()
    _call("cuGraphKernelNodeGetParams", node, ctypes.byref(params))
    if params.func:
        _call("cuFuncGetName", ctypes.byref(name), params.func)
    else:
        _call("cuKernelGetName", ctypes.byref(name), params.kern)
    return name.value.decode()


def _edge_data(kind: Edge) -> ctypes.Array:
    data = (_EdgeData * 1)()
    data[0].from_port, data[0].to_port, data[0].type = kind
    return data


def _remove_edge(graph: int, a: int, b: int, old: Edge) -> None:
    _call("cuGraphRemoveDependencies", graph, (P * 1)(a), (P * 1)(b), _edge_data(old), 1)


def _set_edge(graph: int, a: int, b: int, old: Edge | None, new: Edge) -> None:
    """Add the edge a -> b of kind new, after removing the one of kind old (None: there is none)."""
    if old is not None:
        _remove_edge(graph, a, b, old)
    _call("cuGraphAddDependencies", graph, (P * 1)(a), (P * 1)(b), _edge_data(new), 1)


def make_programmatic(graph: int, producer: Callable[[str], bool], through_memsets: bool = False) -> int:
    """Rewrite every full edge from a kernel whose name satisfies producer into a kernel after it as a
    programmatic edge; returns how many. A kernel with a full edge beside a programmatic one starts
    only once every node before it has completed, so with through_memsets a memset between the two
    (cuBLAS launches one before some products) moves ahead of the producer (after the producer's own
    predecessors), and the producer gets a programmatic edge to the memset's kernel successors. Only
    where the producer does not touch the memset's buffer (not for cuBLAS after cuBLAS: they share
    the workspace)."""
    count = 0
    for a, b, data in edges(graph):
        if data != FULL or node_type(a) != KERNEL or not producer(node_name(a)):
            continue
        if node_type(b) == KERNEL:
            _set_edge(graph, a, b, FULL, PROGRAMMATIC)
            count += 1
        elif through_memsets and node_type(b) == MEMSET:
            now = edges(graph)
            _remove_edge(graph, a, b, FULL)
            for pred, node, kind in now:
                if node == a:
                    _set_edge(graph, pred, b, None, FULL)
                if pred == b and node_type(node) == KERNEL:
                    _remove_edge(graph, b, node, kind)
                    _set_edge(graph, a, node, None, PROGRAMMATIC)
                    count += 1
            _set_edge(graph, b, a, None, FULL)
    return count
