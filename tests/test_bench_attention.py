"""benchmarks/kernels/bench_attention.py on CPU: its cases take the draft's head counts, and a bad --heads
fails with a clear message before anything runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def test_decode_case_takes_the_head_counts(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH.parent))
    from benchmarks.kernels.bench_attention import decode_case

    gen = torch.Generator().manual_seed(0)
    q, k, v, caches, meta = decode_case(3, 40, 2, torch.device("cpu"), gen, queries=5, heads=(16, 8))
    assert q.shape == (15, 16, 128) and k.shape == v.shape == (15, 8, 128)
    assert len(caches) == 2 and caches[0][0].shape == (3 * 3 + 1, 16, 8, 128)
    assert meta.query_start_loc.tolist() == [0, 5, 10, 15] and meta.seq_lens.tolist() == [40] * 3
    # the last 5 positions of each sequence, through its own (shuffled) blocks
    tables = meta.block_tables.long()
    want = torch.cat([tables[b, p // 16] * 16 + p % 16 for b in range(3) for p in torch.arange(35, 40)[None]])
    assert torch.equal(meta.slot_mapping, want)


@pytest.mark.parametrize("heads", ["16", "16,6", "0,8", "16,8,2"])
def test_bad_heads_fail_before_running(heads):
    proc = subprocess.run(
        [sys.executable, str(BENCH / "kernels" / "bench_attention.py"), "--heads", heads],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert f"--heads takes 'query heads,KV heads', a multiple of the KV heads, got '{heads}'" in proc.stderr


def test_relayout_keeps_the_values_and_stores_heads_together(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH.parent))
    from benchmarks.kernels.bench_attention import relayout

    cache = torch.randn(5, 16, 8, 128)
    assert relayout(cache, "nhd") is cache
    hnd = relayout(cache, "hnd")
    assert hnd.shape == cache.shape and torch.equal(hnd, cache)
    # one head's 16 rows of a block are adjacent in memory: [blocks, HKV, 16, D] storage
    assert hnd.stride() == (8 * 16 * 128, 128, 16 * 128, 1)


@pytest.mark.parametrize(("flag", "value", "message"), [
    ("--layouts", "nhd,xyz", "--layouts takes nhd and/or hnd, comma-separated, got 'nhd,xyz'"),
    ("--repeats", "0", "--repeats must be >= 1, got 0"),
])  # fmt: skip
def test_bad_layouts_or_repeats_fail_before_running(flag, value, message):
    proc = subprocess.run(
        [sys.executable, str(BENCH / "kernels" / "bench_attention.py"), flag, value],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert message in proc.stderr
