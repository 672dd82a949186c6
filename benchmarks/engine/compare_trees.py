"""Two source trees of thinkspec side by side on one GPU: plain decode and the speculative round.

Each tree runs in its own worker process (PYTHONPATH = that tree's root, so `import thinkspec` takes
its code) that builds the same engines through the public API only (`LLM` with random "dummy"
weights), so any two versions with that API can be compared. The driver interleaves the trees:
for every cell (mode, batch size) and every repeat it asks the old tree, then the new one (the
order alternates per repeat), so drift of the machine hits both alike. Each worker warms up at
exactly the shapes it times (two full-length runs per cell) before anything is timed; only one
mode's engine is alive per worker at a time, so both trees' models fit on one card.

  plain   LLM(target) greedy decode: --output-len tokens per sequence at each batch size
  spec    LLM(target, draft, k=--k) greedy: the speculative round (random weights accept almost
          nothing, so a round emits about one token; both trees do the same work)

Reports per cell the median step time (decode seconds / output tokens) of each tree over the
repeats, its spread (min-max), and new/old. Writes JSON (--out) and prints a table last.

    python benchmarks/engine/compare_trees.py --old /path/to/old --new . --out trees.json   # GPU
    python benchmarks/engine/compare_trees.py --old . --new . --small --device cpu           # smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

MODES = ("plain", "spec")


# ---- worker: one tree, one process ------------------------------------------------------------


def _write_config(folder: Path, shape: dict, vocab: int) -> str:
    """A Qwen3 config.json (no weights: the engine loads dummy ones); returns the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": vocab,
        "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "attention_bias": False, "torch_dtype": "bfloat16", "eos_token_id": vocab - 1, **shape,
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(cfg))
    return str(folder)


class _Worker:
    """Builds one mode's engine at a time and times greedy decode runs on it."""

    def __init__(self, args: argparse.Namespace, tmp: Path) -> None:
        import torch

        self.args = args
        shapes = json.loads(args.shapes)  # the driver's, from benchmarks.common (not imported here)
        vocab = shapes["vocab"]
        self.target = _write_config(tmp / "target", shapes["target"], vocab)
        self.draft = _write_config(tmp / "draft", shapes["draft"], vocab)
        gen = torch.Generator().manual_seed(0)
        batches = [int(b) for b in args.batch_sizes.split(",")]
        self.prompts = torch.randint(0, vocab - 1, (max(batches), args.prompt_len), generator=gen).tolist()
        self.mode: str | None = None
        self.llm = None

    def _build(self, mode: str) -> None:
        import gc

        import torch

        from thinkspec import LLM

        self.llm = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        a = self.args
        common = dict(
            device=a.device, dtype="float32" if a.device == "cpu" else "bfloat16", load_format="dummy",
            skip_tokenizer_init=True, max_num_seqs=max(int(b) for b in a.batch_sizes.split(",")),
            max_model_len=a.prompt_len + a.output_len + 2 * a.k + 8, seed=0,
            max_num_batched_tokens=max(2048, max(int(b) for b in a.batch_sizes.split(",")) * a.prompt_len),
        )  # fmt: skip
        if a.device != "cpu":
            common["kv_cache_memory"] = a.kv_cache_gib << 30
        spec = {"model": self.draft, "num_speculative_tokens": a.k} if mode == "spec" else None
        self.llm = LLM(self.target, speculative_config=spec, **common)
        self.mode = mode

    def _run(self, batch: int) -> float:
        """Seconds from the batch's first token to its last, greedy, --output-len tokens each."""
        from thinkspec import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=self.args.output_len, ignore_eos=True)
        outs = self.llm.generate(self.prompts[:batch], params, use_tqdm=False)
        lengths = {len(o.outputs[0].token_ids) for o in outs}
        if lengths != {self.args.output_len}:
            raise RuntimeError(f"outputs of lengths {sorted(lengths)}, expected {self.args.output_len}")
        return max(o.metrics.finished_time for o in outs) - min(o.metrics.first_token_time for o in outs)

    def handle(self, cmd: dict) -> dict:
        if cmd["op"] == "warm":
            if self.mode != cmd["mode"]:
                self._build(cmd["mode"])
            for _ in range(2):  # the first run captures graphs; the second meets the prefix cache
                self._run(cmd["batch"])
            return {"ok": True}
        if cmd["op"] == "time":
            assert self.mode == cmd["mode"], "time before warm"
            seconds = self._run(cmd["batch"])
            return {"ms_per_step": seconds / (self.args.output_len - 1) * 1e3}
        if cmd["op"] == "info":
            import torch

            import thinkspec

            name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
            return {"thinkspec": str(Path(thinkspec.__file__).resolve().parent), "device": name}
        raise ValueError(f"unknown op {cmd['op']!r}")


def worker_main(args: argparse.Namespace) -> None:
    """Reads one JSON command per line on stdin, answers one JSON line on stdout each."""
    import tempfile

    out = sys.stdout
    sys.stdout = sys.stderr  # the engine's own prints must not mix with the answers
    with tempfile.TemporaryDirectory() as tmp:
        worker = _Worker(args, Path(tmp))
        for line in sys.stdin:
            out.write(json.dumps(worker.handle(json.loads(line))) + "\n")
            out.flush()


# ---- driver -------------------------------------------------------------------------------------


class _Tree:
    def __init__(self, name: str, root: Path, argv: list[str]) -> None:
        env = dict(os.environ, PYTHONPATH=str(root))
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", *argv]
        self.name = name
        self.proc = subprocess.Popen(cmd, env=env, cwd=root, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)  # fmt: skip

    def ask(self, **cmd) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.name} tree's worker died (exit {self.proc.wait()})")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=120)


def _shapes(small: bool) -> dict:
    """The target's and draft's config fields and the vocabulary, from benchmarks.common. Only the driver
    imports it: a worker's thinkspec may be a tree older than that module's imports."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
    from benchmarks.common import QWEN3_0_6B, QWEN3_8B, QWEN_VOCAB, SMALL_DRAFT, SMALL_TARGET

    if small:
        return {"target": SMALL_TARGET, "draft": SMALL_DRAFT, "vocab": 1024}
    return {"target": QWEN3_8B, "draft": QWEN3_0_6B, "vocab": QWEN_VOCAB}


def _summary(times: list[float]) -> dict:
    return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times), "reps": times}


def drive(args: argparse.Namespace, argv: list[str]) -> dict:
    trees = [_Tree("old", Path(args.old).resolve(), argv), _Tree("new", Path(args.new).resolve(), argv)]
    result: dict = {"trees": {t.name: t.ask(op="info") for t in trees}, "cells": []}
    if args.old != args.new and len({r["thinkspec"] for r in result["trees"].values()}) != 2:
        raise RuntimeError(f"both workers import the same thinkspec: {result['trees']}")
    batches = [int(b) for b in args.batch_sizes.split(",")]
    try:
        for mode in args.modes.split(","):
            for batch in batches:
                for t in trees:
                    t.ask(op="warm", mode=mode, batch=batch)
                times: dict[str, list[float]] = {t.name: [] for t in trees}
                for rep in range(args.repeats):
                    for t in trees if rep % 2 == 0 else trees[::-1]:
                        times[t.name].append(t.ask(op="time", mode=mode, batch=batch)["ms_per_step"])
                cell = {"mode": mode, "batch": batch, **{n: _summary(v) for n, v in times.items()}}
                cell["new_over_old"] = cell["new"]["median_ms"] / cell["old"]["median_ms"]
                result["cells"].append(cell)
                ratio = cell["new_over_old"]
                print(f"  {mode} batch {batch}: new/old {ratio:.3f}", file=sys.stderr, flush=True)
                if args.out:
                    Path(args.out).write_text(json.dumps(result, indent=1))
    finally:
        for t in trees:
            t.close()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old", default=".", help="root of the baseline tree (holds thinkspec/)")
    p.add_argument("--new", default=".", help="root of the tree under test")
    p.add_argument("--modes", default="plain,spec", help=f"comma-separated, of {MODES}")
    p.add_argument("--batch-sizes", default="1,16,64")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--kv-cache-gib", type=int, default=4, help="KV cache per engine (GPU)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke test)")
    p.add_argument("--out", default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--shapes", default=None, help=argparse.SUPPRESS)  # JSON, driver -> worker
    args = p.parse_args()
    if args.worker:
        worker_main(args)
        return
    unknown = set(args.modes.split(",")) - set(MODES)
    if unknown:
        raise SystemExit(f"--modes: unknown {sorted(unknown)} (allowed: {', '.join(MODES)})")
    passed = ["--batch-sizes", args.batch_sizes, "--prompt-len", str(args.prompt_len),
              "--output-len", str(args.output_len), "--k", str(args.k),
              "--kv-cache-gib", str(args.kv_cache_gib), "--device", args.device]  # fmt: skip
    passed += ["--shapes", json.dumps(_shapes(args.small))]
    result = drive(args, passed)
    print(f"device: {result['trees']['new']['device']}")
    head = f"{'old ms':>8} {'(min-max)':>15} {'new ms':>8} {'(min-max)':>15}"
    print(f"{'mode':>5} {'batch':>5} {head} {'new/old':>7}")
    for c in result["cells"]:
        o, n = c["old"], c["new"]
        old = f"{o['median_ms']:>8.3f} {o['min_ms']:>7.3f}-{o['max_ms']:<7.3f}"
        new = f"{n['median_ms']:>8.3f} {n['min_ms']:>7.3f}-{n['max_ms']:<7.3f}"
        print(f"{c['mode']:>5} {c['batch']:>5} {old} {new} {c['new_over_old']:>7.3f}")


if __name__ == "__main__":
    main()
