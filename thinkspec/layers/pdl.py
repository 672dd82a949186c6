"""Programmatic dependent launch (PDL) for the Triton kernels of a model step (Hopper and newer).

A kernel launched with PDL may be placed on free SMs while the kernel before it in the stream still
runs. Its programs then stop at `gdc_wait` (PTX griddepcontrol.wait) until that kernel has finished
and its writes are visible. A decode step is a chain of a few hundred short kernels; PDL hides part
of each one's launch behind the end of the one before (H200, Qwen3-8B shape: the batch-1 step
2-4% shorter, batch 16 and 64 unchanged within 1%; docs/BENCHMARKS.md, "Programmatic dependent
launch").

Rules every kernel launched this way keeps:
  - `wait_prior` first: nothing is loaded or stored before the wait (only index arithmetic);
  - `release_next` once its main work is done (before its final stores): from then on the next
    kernel may be placed, once every program of this one has got there or exited. (Releasing right
    after the wait, so that the next kernel's programs wait on the SMs for the whole of this one,
    measured 1.6-2% slower at batch 16; prefetching up to 16 MiB of a product's weight into L2
    before the wait, in the skinny GEMM and the GEMV, 0.5-5% slower at batch 1 to 64; the GEMV
    reading its first weight tile into registers before the wait, under 1% faster at batch 1-2.)
`EARLY_RELEASE` (on) bends both rules at up to EARLY_MAX_ROWS rows, where the two alone did not
pay but together do: the norm and GEMV kernels release right after their wait, and the GEMV, so
placed while the kernel before it runs, reads its first weight tile before its wait (no kernel of a
step writes a weight; activations still wait). Not attention: its tiles do not depend on the token
count, so an eager launch (its count varies in a run) would need a second build of tiles a graph
built early, in mid-run (seen on the H200). Qwen3-0.6B shape step: batch 1 0.89 ->
0.85 ms, batch 2 0.98 -> 0.96-0.97 ms (two calls); at 4 rows 1.34 -> 1.43 ms slower, so 2 rows at
most (docs/BENCHMARKS.md, "Programmatic dependent launch (PDL)").
`PREFETCH` (on) bends the first rule for inputs no kernel of a forward writes. The q/k norm + rotary
kernel reads its token's position, KV slot, rotary row and q/k norm weights before its wait
(positions and slots are copied in, or gathered by normal launches, before the forward's first
kernel; the rotary table and the weights are fixed), and RMSNorm reads its weight (the norm weights:
Qwen3-0.6B shape step 1.7% / 2.3% faster at batch 1 / 2; docs/BENCHMARKS.md, "Programmatic dependent
launch (PDL)").
Attention reads its sequence's metadata and first block-table entries before its wait and asks for
that tile's cached keys and values (positions before the query window, written by earlier forwards)
in L2: a hint that changes no value; the kernel reads them after the wait as before. Safe by the next
paragraph: a kernel is placed only once the kernel before it has passed its own wait.
When a kernel's wait returns, the kernel before it has completed, and that one had passed its own
wait (or was launched normally), so every earlier kernel of the stream has completed too. Kernels
launched normally (cuBLAS, torch ops) keep full stream order before and after. CUDA-graph capture
records the dependencies as programmatic edges, so replays overlap the same way.

`ENABLED` switches PDL off for the whole process. Launches read it, so a CUDA graph keeps what was
set when it was captured. On CPU (TRITON_INTERPRET=1) and before Hopper nothing changes:
kernels get PDL=False and a normal launch.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

ENABLED = True
EARLY_RELEASE = True  # see above; read at launch, as ENABLED
EARLY_MAX_ROWS = 2  # measured slower at 4 rows
PREFETCH = True  # see above; read at launch, as ENABLED


@functools.cache
def _supported(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def hopper_or_newer(device: torch.device) -> bool:
    """Whether device is a CUDA GPU of compute capability 9 or newer (asked once per GPU)."""
    if device.type != "cuda":
        return False
    return _supported(device.index if device.index is not None else torch.cuda.current_device())


def use_pdl(device: torch.device) -> bool:
    """Whether launches on device go out with PDL (ENABLED, CUDA, compute capability 9 or newer)."""
    return ENABLED and hopper_or_newer(device)


def launch_args(device: torch.device) -> dict:
    """Keyword arguments of a Triton launch: the kernel's PDL constexpr and the launch option."""
    if use_pdl(device):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


def early_release(rows: int) -> bool:
    """The EARLY constexpr of a launch over this many rows (see EARLY_RELEASE)."""
    return EARLY_RELEASE and rows <= EARLY_MAX_ROWS


def prefetch() -> bool:
    """The PREFETCH constexpr of an attention or q/k norm + rotary launch (see PREFETCH)."""
    return PREFETCH


@triton.jit
def wait_prior(PDL: tl.constexpr):
    """Wait for the kernel before this one to finish (PDL launches); first thing in a kernel."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def release_next(PDL: tl.constexpr):
    """Let the next kernel be placed (PDL launches): this program's remaining work is its stores."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
