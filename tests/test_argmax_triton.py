"""The greedy argmax kernel (sampling/argmax_triton.py) against torch.argmax.

On CPU the kernel runs under the Triton interpreter in a child pytest (`test_kernels_under_interpreter`);
run those cases directly with `TRITON_INTERPRET=1 pytest tests/test_argmax_triton.py -k test_interp_`.
The kernel must give torch.argmax's answer exactly: the lowest index of the max, NaN above everything
(the first NaN wins), 0 for a row of -inf. Small vocabulary tiles (`block`) give many chunks per row, so
the cross-chunk merge is exercised at interpreter-friendly sizes.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not importable")

from triton_interpreter import interp, parent_only, run_interpreter_cases  # noqa: E402

from thinkspec.sampling import argmax_triton  # noqa: E402
from thinkspec.sampling.argmax_triton import argmax_triton as kernel_argmax  # noqa: E402
from thinkspec.sampling.rejection_triton import counters  # noqa: E402
from thinkspec.sampling.sampler import greedy_sample  # noqa: E402

gpu = pytest.mark.gpu
INF, NAN = float("inf"), float("nan")


@parent_only
def test_kernels_under_interpreter():
    run_interpreter_cases(__file__)


def _special_rows(v: int, block: int) -> torch.Tensor:
    """[R, v] rows that probe the merge: ties within and across chunks, -inf, NaN, +inf, -0.0, edges."""
    rows = []
    last = v - 1
    base = torch.zeros(v)
    rows.append(base.clone())  # all equal: index 0
    r = torch.full((v,), -INF)
    rows.append(r)  # all -inf: index 0
    r = torch.full((v,), -INF)
    r[last] = -1e30
    rows.append(r)  # the only finite entry at the vocabulary's last index
    r = torch.randn(v)
    r[min(block + 3, last)] = 9.0
    r[last] = 9.0
    rows.append(r)  # tie across chunks: the earlier chunk's index
    r = torch.randn(v)
    r[last] = NAN
    r[0] = INF
    rows.append(r)  # NaN beats +inf
    r = torch.randn(v)
    r[min(2 * block + 1, last)] = NAN
    r[min(block + 1, last)] = NAN
    rows.append(r)  # two NaNs: the first
    r = torch.full((v,), -0.0)
    r[last] = 0.0
    rows.append(r)  # -0.0 == 0.0: index 0
    r = torch.randn(v)
    r[last] = INF
    r[0] = INF
    rows.append(r)  # +inf tie: index 0
    r = torch.randn(v)
    r[last] = 50.0
    rows.append(r)  # max at the last index
    return torch.stack(rows)


@interp
@pytest.mark.parametrize("v,block", [(1, 16), (7, 16), (16, 16), (17, 16), (100, 16), (300, 64), (1000, 128)])
def test_interp_argmax_matches_torch(v, block):
    g = torch.Generator().manual_seed(v)
    x = torch.cat([torch.randn(3, v, generator=g), _special_rows(v, block)])
    torch.testing.assert_close(kernel_argmax(x, block=block), x.argmax(dim=-1), rtol=0, atol=0)
    assert not counters(1, x.device)[: x.shape[0]].any()  # every row's counter back at zero


@interp
def test_interp_argmax_into_a_column_and_repeated_launches():
    # out is a strided column of a wider buffer (the draft's [R, k] drafts); the other columns stay
    g = torch.Generator().manual_seed(1)
    drafts = torch.full((5, 4), -7, dtype=torch.int64)
    for j in range(3):  # the counters left at zero let the next launch merge correctly
        x = torch.randn(5, 333, generator=g)
        x[j, 200] = x[j, 10] = 100.0
        kernel_argmax(x, out=drafts[:, j], block=32)
        assert drafts[:, j].tolist() == x.argmax(dim=-1).tolist()
    assert drafts[:, 3].tolist() == [-7] * 5


def test_greedy_sample_on_cpu_is_torch_argmax():
    x = torch.cat([torch.randn(4, 50), _special_rows(50, 16)])
    assert torch.equal(greedy_sample(x), x.argmax(dim=-1))
    out = torch.empty(8, 2, dtype=torch.int64)[:, 1]
    x = x[:8]
    assert greedy_sample(x, out=out) is out and torch.equal(out, x.argmax(dim=-1))
    assert not argmax_triton.use_kernel(x)


@pytest.mark.parametrize("out", [torch.empty(3, dtype=torch.int32), torch.empty(4, dtype=torch.int64)])
def test_argmax_out_must_fit(out):
    with pytest.raises(ValueError, match="out must be int64 \\[3\\]"):
        greedy_sample(torch.randn(3, 10), out=out)
    with pytest.raises(ValueError, match="out must be int64 \\[3\\]"):
        kernel_argmax(torch.randn(3, 10), out=out)


@gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 2, 16, 64])
def test_gpu_argmax_matches_torch_at_qwen3_vocab(rows):
    v = 151936
    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, v, device="cuda", generator=g)
    x[0, v - 1] = x.max() + 1  # vocabulary edge
    if rows > 1:
        x[1] = x[1].max()  # a row of one value: index 0
    special = _special_rows(v, argmax_triton.BLOCK).cuda()
    for batch in (x, special, torch.cat([x, special])):
        assert argmax_triton.use_kernel(batch)
        torch.testing.assert_close(greedy_sample(batch), batch.argmax(dim=-1), rtol=0, atol=0)
    assert not counters(1, x.device)[: rows + special.shape[0]].any()


@gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_argmax_under_capture_uses_torch():
    x = torch.randn(2, 1000, device="cuda")
    out = torch.empty(2, dtype=torch.int64, device="cuda")
    greedy_sample(x, out=out)  # warm
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        assert not argmax_triton.use_kernel(x)
        greedy_sample(x, out=out)
    x.copy_(torch.randn(2, 1000, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, x.argmax(dim=-1))


@interp
def test_interp_bench_argmax_smoke(tmp_path):
    # benchmarks/kernels/bench_argmax.py on CPU: each method checked against torch, JSON and table written
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "argmax.json"
    cmd = [sys.executable, "benchmarks/kernels/bench_argmax.py", "--device", "cpu", "--vocab", "300",
           "--rows", "1,3",
           "--rounds", "1", "--calls", "1", "--out", str(out)]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(root), TRITON_INTERPRET="1")
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert [c["rows"] for c in report["results"]] == [1, 3] and "triton / torch" in proc.stdout
