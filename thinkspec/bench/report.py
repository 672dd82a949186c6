"""Sweep and bench outputs: JSON, CSV, a text table, the Pareto plot and the markdown report."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

from thinkspec.bench.results import Calibration, SweepResult

TABLE_COLUMNS = (
    ("name", "cell", "{}"),
    ("accuracy", "acc", "{:.3f}"),
    ("accuracy_ci_low", "acc lo", "{:.3f}"),
    ("accuracy_ci_high", "acc hi", "{:.3f}"),
    ("vs_strict_diff", "d strict", "{:+.3f}"),
    ("vs_strict_ci_low", "d lo", "{:+.3f}"),
    ("vs_strict_ci_high", "d hi", "{:+.3f}"),
    ("vs_strict_mcnemar_p", "McNemar p", "{:.3g}"),
    ("mean_acceptance_length", "AL", "{:.2f}"),
    ("thinking_acceptance_length", "AL think", "{:.2f}"),
    ("answer_acceptance_length", "AL ans", "{:.2f}"),
    ("relaxed_share", "relaxed", "{:.3f}"),
    ("implied_tv", "TV", "{:.4f}"),
    ("tokens_per_s", "tok/s", "{:.0f}"),
    ("latency_mean_s", "lat s", "{:.2f}"),
    ("mean_output_tokens", "len", "{:.1f}"),
    ("truncation_rate", "trunc", "{:.3f}"),
)


def _fmt(value: Any, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, bool):
        return "*" if value else ""
    return spec.format(value)


def format_table(rows: list[dict[str, Any]], markdown: bool = False) -> str:
    """Rows as an aligned text table (or a markdown table); missing values print as '-'."""
    cols = [c for c in TABLE_COLUMNS if any(c[0] in r for r in rows)]
    cells = [[_fmt(r.get(key), spec) for key, _, spec in cols] for r in rows]
    head = [h for _, h, _ in cols]
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in cells]
        return "\n".join(lines)
    widths = [max(len(h), *(len(row[i]) for row in cells)) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(head, widths)))]
    for row in cells:
        lines.append(
            "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
        )
    return "\n".join(lines)


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def write_json(data: dict[str, Any], path: str | Path) -> None:
    Path(path).write_text(json.dumps(_jsonable(data), indent=1), encoding="utf-8")


def write_csv(rows: list[dict[str, Any]], path: str | Path) -> None:
    """One line per row; list values (per-position acceptance) as ';'-joined numbers."""
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        for r in rows:
            w.writerow(
                {k: ";".join(f"{x:.6g}" for x in v) if isinstance(v, list) else v for k, v in r.items()}
            )


def plot_pareto(result: SweepResult, path: str | Path) -> None:
    """Acceptance length and tokens/s against accuracy, one panel each, per temperature; the
    Pareto frontier of each temperature drawn as a line through its cells."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result.rows()
    panels = (
        ("mean_acceptance_length", "acceptance_length", "mean acceptance length"),
        ("tokens_per_s", "tokens_per_s", "tokens/s"),
    )
    fig, axes = plt.subplots(1, 2, figsize=(12, 5))
    markers = {"no_spec": "s", "strict": "D", "relaxed": "o", "lenient": "^", "typical": "v"}
    for ax, (key, metric, label) in zip(axes, panels):
        for ti, t in enumerate(result.temperatures):
            color = f"C{ti}"
            group = [r for r in rows if r["temperature"] == t and r.get(key) is not None]
            for r in group:
                ax.scatter(
                    r["accuracy"],
                    r[key],
                    color=color,
                    marker=markers.get(r.get("relax_rule") or r["mode"], "o"),
                    edgecolors="black" if r[f"frontier_{metric}"] else "none",
                    s=50,
                    zorder=3,
                )
                tag = r["mode"] if r["mode"] != "relaxed" else r["name"].split(" ", 1)[1]
                ax.annotate(
                    tag, (r["accuracy"], r[key]), fontsize=7, xytext=(3, 3), textcoords="offset points"
                )
            front = sorted((r for r in group if r[f"frontier_{metric}"]), key=lambda r: r["accuracy"])
            ax.plot(
                [r["accuracy"] for r in front],
                [r[key] for r in front],
                color=color,
                lw=1.5,
                label=f"T={t:g} frontier",
            )
        ax.set_xlabel("accuracy")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(
        f"relaxation sweep, {result.config.get('num_prompts')} prompts per cell "
        "(square: no speculation, diamond: strict, circle: top-k/ratio, triangle up: lenient, "
        "down: typical; outlined: on the frontier)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _short_paths(spec: dict[str, Any]) -> dict[str, Any]:
    """The bundled toy checkpoints by their short names, so a report does not show install paths."""
    from thinkspec.model_names import TOY_MODELS

    names = {str(path): name for name, path in TOY_MODELS.items()}
    return {k: names.get(v, v) if isinstance(v, str) else v for k, v in spec.items()}


def markdown_report(result: SweepResult, calibrations: list[Calibration], plot_name: str | None) -> str:
    cfg = result.config
    level = ""
    if cfg.get("level") and cfg.get("level_params"):
        p = cfg["level_params"]
        level = (
            f" at level {cfg['level']} ({p['min_operands']}-{p['max_operands']} numbers, operands up to "
            f"{p['max_operand']}, totals up to {p['max_value']})"
        )
    lines = [
        "# Relaxed speculative decoding sweep",
        "",
        f"Dataset `{cfg.get('dataset', '?')}`{level}, {cfg.get('num_prompts', '?')} prompts per cell, "
        f"max_tokens "
        f"{cfg.get('max_tokens', '?')}, temperatures {', '.join(f'{t:g}' for t in result.temperatures)}, "
        f"sampling seed {cfg.get('seed', '?')} (item i uses seed + i), device {cfg.get('device', '?')}.",
        "",
        f"Speculative setup (strict): `{json.dumps(_short_paths(cfg['speculative_config']))}`",
        "",
    ]
    if cfg.get("commands"):
        lines += ["Commands (a resumed sweep adds cells to the earlier ones):", ""]
        lines += [f"    {c}" for c in cfg["commands"]] + [""]
    lines += [
        "Accuracy CI: Wilson 95%. `d strict`: accuracy minus strict's on the same prompts, with its "
        "paired bootstrap 95% CI (`d lo`, `d hi`) and the exact McNemar p-value. AL: mean acceptance "
        "length (accepted drafts per verify step + 1), overall / thinking / answer; relaxed: share of "
        "accepted drafts accepted only by the relaxation; TV: the total-variation distance from the "
        "target's p of the distribution each verified draft position emits under the cell's rule, "
        "averaged over the verified positions (0 for lossless acceptance; docs/ACCEPTANCE.md).",
        "",
    ]
    rows = result.rows()
    for t in result.temperatures:
        lines += [
            f"## Temperature {t:g}",
            "",
            format_table([r for r in rows if r["temperature"] == t], True),
            "",
        ]
        front = [r["name"] for r in rows if r["temperature"] == t and r.get("frontier_tokens_per_s")]
        front_al = [r["name"] for r in rows if r["temperature"] == t and r.get("frontier_acceptance_length")]
        lines += [
            f"Pareto frontier (accuracy vs tokens/s): {', '.join(front) or '-'}.",
            f"Pareto frontier (accuracy vs acceptance length): {', '.join(front_al) or '-'}.",
            "",
        ]
        per_pos = [
            (r["name"], r["acceptance_rate_per_pos"])
            for r in rows
            if r["temperature"] == t and r.get("acceptance_rate_per_pos")
        ]
        if per_pos:
            lines += ["Per-position acceptance rate:", ""]
            lines += [f"- {n}: {', '.join(f'{x:.3f}' for x in v)}" for n, v in per_pos]
            lines.append("")
    if plot_name:
        lines += [f"![Pareto plot]({plot_name})", ""]
    if result.hf:
        lines += [
            "## HF transformers, batch 1, greedy (side by side)",
            "",
            f"{result.hf[0].n} prompts, each generated alone.",
            "",
            format_table([c.summary() for c in result.hf], True),
            "",
        ]
    for cal in calibrations:
        lines += [
            f"## Calibration (temperature {cal.temperature:g}, accuracy budget {cal.accuracy_budget:g})",
            "",
            f"Fastest by {cal.by} among settings whose paired 95% CI low end of (accuracy - strict) is "
            f">= -{cal.accuracy_budget:g}: **{cal.chosen}**.",
            "",
            f"```json\n{json.dumps(_short_paths(cal.speculative_config))}\n```",
            "",
        ]
    return "\n".join(lines)


def write_sweep_outputs(
    result: SweepResult, out_dir: str | Path, calibrations: list[Calibration] = (), plot: bool = True
) -> dict[str, Path]:
    """sweep.json, sweep.csv, pareto.png (when plot), report.md in out_dir; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "sweep.json", "csv": out / "sweep.csv", "markdown": out / "report.md"}
    data = result.to_dict()
    data["calibrations"] = [c.to_dict() for c in calibrations]
    write_json(data, paths["json"])
    write_csv(result.rows() + [{**c.summary()} for c in result.hf], paths["csv"])
    plot_name = None
    if plot:
        paths["png"] = out / "pareto.png"
        plot_pareto(result, paths["png"])
        plot_name = paths["png"].name
    paths["markdown"].write_text(markdown_report(result, list(calibrations), plot_name), encoding="utf-8")
    return paths
