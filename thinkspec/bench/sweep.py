"""The relaxation sweep: relax_ratio x relax_top_k (x relax_delta), lenient lambdas and typical
(posterior_threshold, posterior_alpha) settings against two baselines.

Every cell answers the same items with the same per-item seeds. One speculative LLM (strict
config) serves the strict cell and, through the per-request overrides in SamplingParams, every
relaxed cell; one plain LLM serves the no-speculation baseline. Each cell's accuracy is compared
with strict at the same temperature by a paired bootstrap CI and an exact McNemar test.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from thinkspec.bench.bench import format_prompts, run_cell, run_round_robin, sampling_params_for
from thinkspec.bench.datasets import BenchItem
from thinkspec.bench.results import SPEED_METRICS, Calibration, CellResult, SweepResult, cell_name
from thinkspec.bench.warmth import capture_graphs
from thinkspec.config import RELAX_RULES, SpeculativeConfig, validate_relax_fields, validate_rule_fields
from thinkspec.llm import LLM
from thinkspec.model_names import toy_name


@dataclass(slots=True, frozen=True)
class RelaxSetting:
    """One relaxed cell of the grid: a topk_ratio setting (ratio, top-k, delta), or a lenient
    (relax_lambda) or typical (posterior_threshold, posterior_alpha) one (`lenient`, `typical`)."""

    relax_ratio: float
    relax_top_k: int
    relax_delta: float | None = None
    relax_rule: str = RELAX_RULES[0]
    relax_lambda: float | None = None
    posterior_threshold: float | None = None
    posterior_alpha: float | None = None

    def __post_init__(self) -> None:
        validate_relax_fields(
            relax_ratio=self.relax_ratio,
            relax_top_k=self.relax_top_k,
            relax_delta=self.relax_delta,
            owner="RelaxSetting",
        )
        validate_rule_fields(
            "RelaxSetting", self.relax_rule, self.relax_lambda, self.posterior_threshold, self.posterior_alpha
        )

    @classmethod
    def lenient(cls, relax_lambda: float) -> RelaxSetting:
        return cls(1.0, 1, relax_rule="lenient", relax_lambda=relax_lambda)

    @classmethod
    def typical(cls, posterior_threshold: float, posterior_alpha: float) -> RelaxSetting:
        return cls(1.0, 1, None, "typical", None, posterior_threshold, posterior_alpha)

    @property
    def label(self) -> str:
        if self.relax_rule == "lenient":
            return f"lenient l={self.relax_lambda:g}"
        if self.relax_rule == "typical":
            return f"typical e={self.posterior_threshold:g} a={self.posterior_alpha:g}"
        s = f"r={self.relax_ratio:g} k={self.relax_top_k}"
        return s if self.relax_delta is None else f"{s} d={self.relax_delta:g}"

    def overrides(self) -> dict[str, Any]:
        """SamplingParams fields that turn a request of the strict engine into this setting (a
        topk_ratio setting names no rule, as before the rules existed)."""
        if self.relax_rule == "lenient":
            return {"relaxed_thinking": True, "relax_rule": "lenient", "relax_lambda": self.relax_lambda}
        if self.relax_rule == "typical":
            return {
                "relaxed_thinking": True,
                "relax_rule": "typical",
                "posterior_threshold": self.posterior_threshold,
                "posterior_alpha": self.posterior_alpha,
            }
        return {
            "relaxed_thinking": True,
            "relax_ratio": self.relax_ratio,
            "relax_top_k": self.relax_top_k,
            "relax_delta": self.relax_delta,
        }


def make_grid(
    ratios: Sequence[float], top_ks: Sequence[int], deltas: Sequence[float | None] = (None,)
) -> list[RelaxSetting]:
    """The full product, in ratio-major order."""
    if not ratios or not top_ks:
        raise ValueError(
            f"the grid needs at least one ratio and one top-k, got {list(ratios)} x {list(top_ks)}"
        )
    return [RelaxSetting(r, k, d) for r, k, d in itertools.product(ratios, top_ks, deltas or (None,))]


# One cell of the plan: (mode "no_spec" | "strict" | "relaxed", temperature, relaxed setting or None,
# at most this many requests in flight or None for all at once).
PlannedCell = tuple[str, float, RelaxSetting | None, int | None]


def run_sweep(
    engine_kwargs: dict[str, Any],
    speculative_config: dict[str, Any],
    items: list[BenchItem],
    settings: list[RelaxSetting],
    temperatures: Sequence[float] = (0.0,),
    max_tokens: int = 512,
    seed: int = 0,
    include_no_spec: bool = True,
    warmup: bool = True,
    repeats: int = 3,
    batch_sizes: Sequence[int | None] = (None,),
    use_tqdm: bool = True,
    on_cell: Callable[[SweepResult], None] | None = None,
    config: dict[str, Any] | None = None,
    previous: SweepResult | None = None,
) -> SweepResult:
    """Run the baselines and every relaxed setting at each temperature; `on_cell` after each cell.

    engine_kwargs: LLM(...) arguments without speculative_config. speculative_config: the
    speculative setup (draft model, k, reasoning parser); its relaxation is switched off for
    the strict cell and set per request for the relaxed ones. previous: an interrupted sweep of
    the same dataset and settings whose finished cells are kept instead of rerun. Each cell is timed
    `repeats` times, round-robin with the others, after a warm-up at the timed shapes. batch_sizes:
    caps on the requests in flight, each its own set of cells (None: every request at once).
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if not items:
        raise ValueError("the sweep needs at least one item")
    for t in temperatures:
        if t < 0:
            raise ValueError(f"temperatures must be >= 0, got {t}")
    strict_cfg = _strict_config(speculative_config)
    result = SweepResult(
        config={
            **(config or {}),
            "num_prompts": len(items),
            "temperatures": list(temperatures),
            "max_tokens": max_tokens,
            "seed": seed,
            "speculative_config": {**strict_cfg, "model": toy_name(strict_cfg["model"])},
            "grid": [s.label for s in settings],
            "repeats": repeats,
            "batch_sizes": ["all" if b is None else b for b in batch_sizes],
        }
    )
    order: list[PlannedCell] = []  # report order: by temperature, then batch size
    for t, b in itertools.product(temperatures, batch_sizes):
        if include_no_spec:
            order.append(("no_spec", t, None, b))
        order.append(("strict", t, None, b))
        order += [("relaxed", t, s, b) for s in settings]
    done = _resumable_cells(previous, result.config)
    # Run order: plain cells first, then speculative ones, so each LLM loads once.
    plan = [x for x in order if x[0] == "no_spec"] + [x for x in order if x[0] != "no_spec"]
    plan = [x for x in plan if _planned_name(x) not in done]
    result.cells = list(done.values())
    timing = (warmup, repeats)
    _run_plan(plan, result, engine_kwargs, strict_cfg, items, max_tokens, seed, timing, use_tqdm, on_cell)
    rank = {_planned_name(x): i for i, x in enumerate(order)}
    result.cells.sort(key=lambda c: rank.get(c.name, len(rank)))
    result.config["temperatures"] = result.temperatures  # resumed cells included
    result.compare_all()
    return result


def _strict_config(speculative_config: dict[str, Any]) -> dict[str, Any]:
    """The speculative config with relaxation off; ValueError before any model loads."""
    strict_cfg = {**speculative_config, "relaxed_thinking": False}
    for knob in ("relax_ratio", "relax_top_k", "relax_delta", "relax_rule", "relax_lambda"):
        strict_cfg.pop(knob, None)
    strict_cfg.pop("posterior_threshold", None)
    strict_cfg.pop("posterior_alpha", None)
    SpeculativeConfig.from_dict(strict_cfg)
    return strict_cfg


def _planned_name(cell: PlannedCell) -> str:
    mode, t, setting, batch = cell
    return cell_name(t, mode if setting is None else setting.label, batch)


def _resumable_cells(previous: SweepResult | None, config: dict[str, Any]) -> dict[str, CellResult]:
    """The finished cells of an earlier sweep by name; ValueError when it measured something else."""
    if previous is None:
        return {}
    keys = ("dataset", "level", "level_params", "num_prompts", "max_tokens", "seed", "speculative_config")
    # Files written before levels existed (and configs without them) measured the easy level.
    earlier = {**_level_config(previous.config.get("dataset", ""), "easy"), **previous.config}
    now = {**_level_config(config.get("dataset", ""), "easy"), **config}
    mismatch = [k for k in keys if earlier.get(k) != now.get(k)]
    if mismatch:
        raise ValueError(f"cannot resume: the earlier sweep differs in {mismatch}")
    return {c.name: c for c in previous.cells}


def _run_plan(
    plan: list[PlannedCell],
    result: SweepResult,
    engine_kwargs: dict[str, Any],
    strict_cfg: dict[str, Any],
    items: list[BenchItem],
    max_tokens: int,
    seed: int,
    timing: tuple[bool, int],
    use_tqdm: bool,
    on_cell: Callable[[SweepResult], None] | None,
) -> None:
    """Load the engines the plan needs (both stay resident), warm each at the cells' own batch and
    length, then time the cells round-robin; timing = (warm up, repetitions)."""
    warmup, repeats = timing
    if not plan:
        return
    from tqdm.auto import tqdm

    llms: dict[str, LLM] = {}
    kinds = list(dict.fromkeys(_engine_kind(p) for p in plan))
    # Warm-up: every engine, temperature and acceptance mode at full batch and length, untimed.
    warm_groups = {(_engine_kind(p), p[1], p[0], p[3]): p for p in reversed(plan)} if warmup else {}
    # Loading and warm-up take minutes on a CPU: one bar, a unit per engine loaded, per engine's
    # graphs captured and per warm-up run.
    total = len(kinds) * (2 if warmup else 1) + len(warm_groups)
    bar = tqdm(total=total, desc="loading and warm-up", disable=not use_tqdm, dynamic_ncols=True)
    try:
        for kind in kinds:
            bar.set_postfix_str(f"loading the {kind} engine")
            spec = None if kind == "plain" else strict_cfg
            llms[kind] = LLM(**engine_kwargs, speculative_config=spec)
            result.config["device"] = _device_name(llms[kind])
            bar.update()
        prompts = {kind: format_prompts(llm, items) for kind, llm in llms.items()}

        def runner(planned: PlannedCell) -> Callable[[], CellResult]:
            kind = _engine_kind(planned)
            llm, texts = llms[kind], prompts[kind]
            return lambda: _run_planned_cell(llm, items, texts, planned, max_tokens, seed, False)

        if warmup:
            for kind, llm in llms.items():
                bar.set_postfix_str(f"graphs of the {kind} engine")
                capture_graphs(llm, len(items))
                bar.update()
            for planned in warm_groups.values():
                bar.set_postfix_str(f"warm-up run {_planned_name(planned)}")
                runner(planned)()
                bar.update()
        bar.close()
        first = len(result.cells)
        result.cells += [None] * len(plan)  # type: ignore[list-item]  # filled as the cells finish

        def keep(i: int, cell: CellResult) -> None:
            result.cells[first + i] = cell
            if on_cell is not None:
                on_cell(_finished(result))

        cells = [(llms[_engine_kind(p)], runner(p)) for p in plan]
        run_round_robin(cells, repeats, keep, use_tqdm)
    finally:
        bar.close()
        result.cells = [c for c in result.cells if c is not None]
        _release(llms)


def _engine_kind(planned: PlannedCell) -> str:
    return "plain" if planned[0] == "no_spec" else "spec"


def _finished(result: SweepResult) -> SweepResult:
    """The result with only the cells that have run (for the partial file)."""
    return SweepResult(result.config, [c for c in result.cells if c is not None], hf=result.hf)


def _run_planned_cell(
    llm: LLM,
    items: list[BenchItem],
    prompts: list[str],
    planned: PlannedCell,
    max_tokens: int,
    seed: int,
    use_tqdm: bool,
) -> CellResult:
    """One cell; a relaxed one runs on the strict engine through per-request overrides. A
    speculative cell also records implied_tv: the mean, over its verified draft positions, of the
    TV distance from p of what each position emits (sampling.rejection.implied_tv)."""
    mode, t, setting, batch = planned
    row_setting: dict[str, Any] = {"mode": mode, "temperature": t, "max_in_flight": batch}
    row_setting.update(
        setting.overrides()
        if setting is not None
        else {"relax_ratio": None, "relax_top_k": None, "relax_delta": None}
    )
    row_setting.pop("relaxed_thinking", None)
    overrides = {} if setting is None else setting.overrides()
    name = _planned_name(planned)
    speculator = getattr(llm.llm_engine, "speculator", None)
    probe: list[tuple[Any, Any]] = []
    if speculator is not None:
        speculator.tv_probe = probe
    try:
        args = (llm, items, name, row_setting, t, max_tokens, seed, prompts, use_tqdm, batch)
        cell = run_cell(*args, **overrides)
    finally:
        if speculator is not None:
            speculator.tv_probe = None
    if probe:
        total, count = (sum(float(x[i]) for x in probe) for i in (0, 1))
        cell.extra["implied_tv"] = total / max(count, 1.0)
    return cell


def calibrate(
    result: SweepResult,
    accuracy_budget: float,
    temperature: float,
    by: str = "tokens_per_s",
    max_in_flight: int | None = None,
) -> Calibration:
    """Pick among strict and the relaxed cells at `temperature` those whose paired bootstrap 95%
    CI of (cell accuracy - strict accuracy) has its low end >= -accuracy_budget, and among them the
    fastest by `by` ("tokens_per_s", ties broken by acceptance length, or "acceptance_length",
    ties broken by tokens/s). Strict always qualifies, so there is always an answer."""
    if not 0 <= accuracy_budget <= 1:
        raise ValueError(f"accuracy_budget must be in [0, 1], got {accuracy_budget}")
    if by not in SPEED_METRICS:
        raise ValueError(f"by must be one of {SPEED_METRICS}, got {by!r}")
    if not result.comparisons:
        result.compare_all()
    candidates = []
    for c in result.cells:
        if c.setting["temperature"] != temperature or c.setting["mode"] == "no_spec":
            continue
        if c.setting.get("max_in_flight") != max_in_flight:
            continue
        cmp = result.comparisons[c.name]
        within = c.setting["mode"] == "strict" or cmp["ci_low"] >= -accuracy_budget - 1e-12
        al = c.mean_acceptance_length or 0.0
        key = (c.tokens_per_s, al) if by == "tokens_per_s" else (al, c.tokens_per_s)
        candidates.append(
            {
                "name": c.name,
                "tokens_per_s": c.tokens_per_s,
                "mean_acceptance_length": al,
                "vs_strict_ci_low": cmp["ci_low"],
                "within_budget": within,
                "_key": key,
                "_cell": c,
            }
        )
    if not candidates:
        raise ValueError(f"no speculative cells at temperature {temperature:g} in the sweep")
    best = max((x for x in candidates if x["within_budget"]), key=lambda x: x["_key"])
    cell: CellResult = best["_cell"]
    spec = dict(result.config["speculative_config"])
    if cell.setting["mode"] == "relaxed":
        knobs = ("relax_ratio", "relax_top_k", "relax_delta", "relax_rule", "relax_lambda")
        knobs += ("posterior_threshold", "posterior_alpha")
        spec.update(relaxed_thinking=True, **{k: cell.setting[k] for k in knobs if k in cell.setting})
    spec = SpeculativeConfig.from_dict(spec).to_dict()
    spec = {k: v for k, v in spec.items() if v is not None}
    for x in candidates:
        del x["_key"], x["_cell"]
    return Calibration(temperature, accuracy_budget, by, cell.name, spec, candidates)


def _floats(text: str, flag: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise ValueError(f"{flag} must be comma-separated numbers, got {text!r}") from e


def _calibration_batch(result: SweepResult) -> int | None:
    """Calibrate on the cells with every request at once, else on the largest cap."""
    caps = {c.setting.get("max_in_flight") for c in result.cells}
    return None if None in caps else max(caps)


def _extra_settings(text: str) -> list[RelaxSetting]:
    """--extra-settings "0.1:8:0.2,0.3:3,lenient:0.5,typical:0.09:0.3" -> cells beside the grid,
    each ratio:top_k[:delta], lenient:lambda or typical:posterior_threshold:posterior_alpha."""
    out = []
    for spec in (x.strip() for x in text.split(",") if x.strip()):
        parts = spec.split(":")
        if parts[0] in ("lenient", "typical"):
            out.append(_rule_setting(parts, spec))
            continue
        try:
            if len(parts) not in (2, 3):
                raise ValueError
            ratio, top_k = float(parts[0]), int(parts[1])
            delta = float(parts[2]) if len(parts) == 3 else None
        except ValueError:
            raise ValueError(f"--extra-settings takes ratio:top_k[:delta] items, got {spec!r}") from None
        out.append(RelaxSetting(ratio, top_k, delta))
    return out


def _rule_setting(parts: list[str], spec: str) -> RelaxSetting:
    """lenient:lambda or typical:posterior_threshold:posterior_alpha as a setting."""
    try:
        values = [float(x) for x in parts[1:]]
        if len(values) != (1 if parts[0] == "lenient" else 2):
            raise ValueError
    except ValueError:
        raise ValueError(
            f"--extra-settings takes lenient:lambda and typical:threshold:alpha items, got {spec!r}"
        ) from None
    return RelaxSetting.lenient(*values) if parts[0] == "lenient" else RelaxSetting.typical(*values)


def rule_grid(relax_lambdas: Sequence[float], typical: Sequence[tuple[float, float]]) -> list[RelaxSetting]:
    """Lenient cells, one per lambda, then typical cells, one per (threshold, alpha)."""
    return [RelaxSetting.lenient(lam) for lam in relax_lambdas] + [RelaxSetting.typical(*x) for x in typical]


def _typical_pairs(text: str) -> list[tuple[float, float]]:
    """--typical-settings "0.09:0.3,0.2:0.5" -> [(0.09, 0.3), (0.2, 0.5)]."""
    out = []
    for spec in (x.strip() for x in text.split(",") if x.strip()):
        values = _floats(spec.replace(":", ","), "--typical-settings")
        if len(values) != 2:
            raise ValueError(f"--typical-settings takes threshold:alpha items, got {spec!r}")
        out.append((values[0], values[1]))
    return out


def _batch_sizes(text: str) -> list[int | None]:
    """--batch-sizes "1,16,all" -> [1, 16, None]; None = every request at once."""
    out: list[int | None] = []
    for x in (x.strip() for x in text.split(",") if x.strip()):
        if x == "all":
            out.append(None)
        elif x.isdigit() and int(x) >= 1:
            out.append(int(x))
        else:
            raise ValueError(f"--batch-sizes takes integers >= 1 and 'all', got {x!r}")
    if not out:
        raise ValueError("--batch-sizes needs at least one value")
    return out


def _ints(text: str, flag: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise ValueError(f"{flag} must be comma-separated integers, got {text!r}") from e


def run_sweep_command(args: Any) -> int:
    """`thinkspec sweep`: the grid, the report files, and the calibrated config when asked."""
    import json
    import sys
    from pathlib import Path

    from thinkspec.bench.report import format_table, write_json, write_sweep_outputs

    def fail(message: str) -> int:
        print(f"thinkspec sweep: error: {message}", file=sys.stderr)
        return 2

    try:
        settings, temperatures, kwargs, spec, items = _sweep_inputs(args)
    except ValueError as e:
        return fail(str(e))

    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    partial = out_dir / "sweep.partial.json"
    previous = None
    earlier = partial if partial.is_file() else out_dir / "sweep.json"
    if args.resume and earlier.is_file():
        previous = SweepResult.from_dict(json.loads(earlier.read_text(encoding="utf-8")))
        print(f"resuming: {len(previous.cells)} cells already in {earlier}", file=sys.stderr)
    try:
        result = run_sweep(
            kwargs,
            spec,
            items,
            settings,
            temperatures,
            args.max_tokens,
            args.sampling_seed,
            include_no_spec=not args.skip_no_spec,
            repeats=args.repeats,
            batch_sizes=_batch_sizes(args.batch_sizes),
            use_tqdm=not args.no_progress,
            on_cell=lambda r: write_json(r.to_dict(), partial),
            config=_sweep_config(args, kwargs, previous),
            previous=previous,
        )
    except ValueError as e:
        return fail(str(e))
    if previous is not None and not args.hf_baseline_prompts:
        result.hf = previous.hf  # a resumed sweep keeps the side-by-side runs it already has
    if args.hf_baseline_prompts:
        _run_hf_baselines(result, kwargs, spec["model"], items[: args.hf_baseline_prompts], args)
    calibrations = []
    if args.accuracy_budget is not None:
        calibrations = [
            calibrate(result, args.accuracy_budget, t, args.calibrate_by, _calibration_batch(result))
            for t in result.temperatures
        ]
    paths = write_sweep_outputs(result, out_dir, calibrations, plot=not args.no_plot)
    partial.unlink(missing_ok=True)
    print(format_table(result.rows() + [c.summary() for c in result.hf]))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    for cal in calibrations:
        print(
            f"calibrated (temperature {cal.temperature:g}, budget {cal.accuracy_budget:g}, by {cal.by}): "
            f"{cal.chosen}"
        )
        print(json.dumps(cal.speculative_config))
    return 0


def _sweep_inputs(
    args: Any,
) -> tuple[list[RelaxSetting], list[float], dict[str, Any], dict[str, Any], list[BenchItem]]:
    """(grid, temperatures, engine kwargs, speculative config, items) from the sweep flags;
    ValueError for a bad flag, before any model loads."""
    from thinkspec.bench.datasets import default_max_tokens, load_dataset
    from thinkspec.engine_args import engine_kwargs
    from thinkspec.model_names import DEFAULT_TOY, resolve_model_name

    ratios, top_ks = _floats(args.relax_ratios, "--relax-ratios"), _ints(args.relax_top_ks, "--relax-top-ks")
    # Both empty: no ratio x top-k grid (a sweep of the other rules alone).
    settings = (
        make_grid(ratios, top_ks, _floats(args.relax_deltas, "--relax-deltas") or [None])
        if ratios or top_ks
        else []
    )
    settings += _extra_settings(getattr(args, "extra_settings", ""))
    settings += rule_grid(
        _floats(getattr(args, "relax_lambdas", ""), "--relax-lambdas"),
        _typical_pairs(getattr(args, "typical_settings", "")),
    )
    temperatures = _floats(args.temperatures, "--temperatures")
    if not temperatures:
        raise ValueError("--temperatures needs at least one value")
    if args.accuracy_budget is not None and not 0 <= args.accuracy_budget <= 1:
        raise ValueError(f"--accuracy-budget must be in [0, 1], got {args.accuracy_budget}")
    if args.hf_baseline_prompts < 0:
        raise ValueError(f"--hf-baseline-prompts must be >= 0, got {args.hf_baseline_prompts}")
    kwargs = engine_kwargs(args)
    # Folders, not bundled names: the Hugging Face baseline loads them without the engine.
    kwargs["model"] = resolve_model_name(kwargs["model"])
    spec = kwargs.pop("speculative_config", None)
    if spec is None:
        if args.model != DEFAULT_TOY:
            raise ValueError("--speculative-config is required (the draft model and k to sweep with)")
        spec = {"model": "toy-reasoner-draft", "num_speculative_tokens": 4}
    if isinstance(spec.get("model"), str):
        spec["model"] = resolve_model_name(spec["model"], "speculative_config.model")
    spec.setdefault("reasoning_parser", kwargs.get("reasoning_parser") or "qwen3")
    if args.max_tokens is None:
        args.max_tokens = default_max_tokens(args.dataset, args.level)
    for t in temperatures:
        sampling_params_for(1, t, args.max_tokens, args.sampling_seed)  # fail before loading
    items = load_dataset(args.dataset, args.num_prompts, args.dataset_seed, args.level)
    return settings, temperatures, kwargs, spec, items


def _sweep_config(args: Any, kwargs: dict[str, Any], previous: SweepResult | None) -> dict[str, Any]:
    """What the report records about the run, with every command line that added cells."""
    import shlex
    import sys

    config: dict[str, Any] = {
        "dataset": args.dataset,
        **_level_config(args.dataset, args.level),
        "model": toy_name(kwargs["model"]),
        "device": kwargs.get("device", "auto"),
        "dtype": kwargs.get("dtype", "auto"),
    }
    # Every invocation that added cells, in order: a resumed sweep's report lists them all.
    commands = [] if previous is None else list(previous.config.get("commands", []))
    if sys.argv[1:2] == ["sweep"]:
        commands.append("thinkspec " + shlex.join(sys.argv[1:]))
    config["commands"] = commands
    return config


def _level_config(dataset: str, level: str) -> dict[str, Any]:
    """What a sweep records about the toy level: its name and its parameters (a level's constants
    can change between versions; a resumed sweep must not mix two)."""
    if dataset != "toy":
        return {"level": None, "level_params": None}
    from dataclasses import asdict

    from thinkspec.toy.task import LEVELS

    return {"level": level, "level_params": asdict(LEVELS[level])}


# HF transformers spells these dtypes by their long names.
_HF_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}


def _run_hf_baselines(
    result: SweepResult, kwargs: dict[str, Any], draft_model: str, items: list[BenchItem], args: Any
) -> None:
    """Append HF transformers generate and assisted generation (batch 1, greedy) to result.hf."""
    from thinkspec.bench.hf_baseline import run_hf_generate

    device = "cuda" if kwargs.get("device", "auto") in ("auto", "cuda") and _cuda() else "cpu"
    dtype = _HF_DTYPES.get(kwargs.get("dtype", "auto"), kwargs.get("dtype", "auto"))
    if dtype == "auto":  # as the engine: the checkpoint's bf16 on GPU, fp32 on CPU
        dtype = "bfloat16" if device == "cuda" else "float32"
    for draft in (None, draft_model):
        result.hf.append(
            run_hf_generate(
                kwargs["model"], items, draft, args.max_tokens, device, dtype, use_tqdm=not args.no_progress
            )
        )


def _release(llms: dict[str, LLM]) -> None:
    """Drop the engines and return their memory: the next engine sizes its KV pool from what is free."""
    import gc

    import torch

    llms.clear()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _device_name(llm: LLM) -> str:
    import torch

    device = torch.device(llm.llm_engine.device)
    dtype = str(llm.llm_engine.model_info.dtype).removeprefix("torch.")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return f"{name}, {dtype}"


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()
