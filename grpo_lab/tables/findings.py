"""Findings: what we found, computed from the runs, next to what the paper found; the variants'
legend; and `build`, which writes the table (markdown, CSV, PNG) with these in its header."""

from __future__ import annotations

import json
import math

from grpo_lab.report import build_report, group_runs, load_runs, mean_ci, paired_diff_ci, welch_diff_ci
from grpo_lab.report.table import ACC, final_value
from grpo_lab.tables.plan import Plan
from grpo_lab.tables.spec import VARIANT_GROUP, TableSpec, override_key


def _pct(x: float) -> str:
    return "nan" if math.isnan(x) else f"{100 * x:.1f}"


def group_variant(group) -> str | None:
    """The variant a row's runs share (also when rows are grouped by config keys), else None."""
    if VARIANT_GROUP in group.values:
        return group.values[VARIANT_GROUP]
    names = {r.override_map.get(VARIANT_GROUP) for r in group.runs}
    return names.pop() if len(names) == 1 else None


def difference(row: dict, base: dict) -> tuple[float, float, str]:
    """(Δ = row − base, 95% half-width, how): paired over the seeds both rows completed when there are
    at least 2 (same seed = same warm-up checkpoint and prompt order, so the shared seed-to-seed spread
    cancels), else Welch's unpaired interval."""
    d, half, n = paired_diff_ci(row["by_seed"], base["by_seed"])
    if n >= 2:
        return d, half, "paired"
    d, half = welch_diff_ci(row["accs"], base["accs"])
    return d, half, "Welch"


def findings(spec: TableSpec, groups: list, keys: list[str]) -> tuple[str, dict]:
    """Markdown "what we found" computed from the groups, and the numbers behind it; with spec.within
    (e.g. [task]) one such section per block, each row compared with its own block's baseline."""
    if not spec.within:
        return block_findings(spec, groups, keys)
    blocks: dict[str, list] = {}
    for g in groups:
        blocks.setdefault(" ".join(f"{k}={g.values.get(k)}" for k in spec.within), []).append(g)
    texts, numbers = [], {"blocks": {}, "rows": {}}
    for name, block in blocks.items():
        text, found = block_findings(spec, block, keys)
        texts.append(f"*{name}*\n\n{text}")
        numbers["blocks"][name] = found
        numbers["rows"].update({f"{name} {row}": acc for row, acc in found.get("rows", {}).items()})
    return "\n\n".join(texts), numbers


def block_findings(spec: TableSpec, groups: list, keys: list[str]) -> tuple[str, dict]:
    """One comparison: every row of `groups` against the baseline row among them."""
    rows = []
    for g in groups:
        by_seed = {r.seed: v for r in g.runs_for_stats() if (v := final_value(r, ACC)) is not None}
        accs = list(by_seed.values())
        mean, half, n = mean_ci(accs)
        rows.append({"group": g, "label": g.label, "accs": accs, "by_seed": by_seed, "mean": mean, "half": half,
                     "n": n})
    scored = [r for r in rows if r["n"] > 0]
    if not scored:
        return ("**What we found:** no run completed, so there is nothing to compare (see the failed runs "
                "below).", {"best": None})
    paper = {v.name: v.paper for v in spec.variants if v.paper is not None}
    if spec.sft_control and spec.sft_control.paper:
        paper["sft_control"] = spec.sft_control.paper

    def is_base(r) -> bool:
        if spec.baseline is None:
            return False
        if "=" in spec.baseline:
            k, _, v = spec.baseline.partition("=")
            return r["group"].values.get(k) == v
        return group_variant(r["group"]) == spec.baseline

    base = next((r for r in scored if is_base(r)), scored[0])
    best = max(scored, key=lambda r: r["mean"])
    multi = all(r["n"] >= 2 for r in scored)
    diffs = {id(r): difference(r, base) for r in scored if r is not base}
    halves = [dh for _, dh, _ in diffs.values() if not math.isnan(dh)]
    how = sorted({k for _, _, k in diffs.values()})
    lines = ["**What we found** (computed from the runs below: final greedy held-out accuracy, mean ± 95% CI "
             "over completed seeds; Δ = difference to the baseline row, "
             + ("paired by seed" if how == ["paired"] else "/".join(how) or "none") + ", with its 95% CI"
             + (f"; widest Δ half-width in this table: **{100 * max(halves):.1f} pp**" if halves else "") + "):", ""]
    with_paper = bool(paper)
    head = "| Row |" + ((" Paper" + (f" ({spec.paper_metric})" if spec.paper_metric else "") + " |") if with_paper
                       else "") + " Ours: final acc. (%) | Δ vs baseline (pp) | CI overlaps baseline |"
    lines += [head, "|---|" + ("---:|" if with_paper else "") + "---:|---:|---|"]
    for r in rows:
        name = group_variant(r["group"]) or r["label"]
        p = f" {paper.get(group_variant(r['group']) or '', '–')} |" if with_paper else ""
        if r["n"] == 0:
            lines.append(f"| {name} |{p} – (no completed run) | – | – |")
            continue
        ours = f"{_pct(r['mean'])} ± {_pct(r['half']) if r['n'] > 1 else 'n/a'} (n={r['n']})"
        if r is base:
            lines.append(f"| {name} (baseline) |{p} {ours} | 0 | – |")
            continue
        d, dh, _ = diffs[id(r)]
        overlap = "n/a (one seed)" if math.isnan(r["half"]) or math.isnan(base["half"]) else (
            "yes" if abs(r["mean"] - base["mean"]) <= r["half"] + base["half"] else "no")
        dtxt = f"{100 * d:+.1f}" + ("" if math.isnan(dh) else f" ± {100 * dh:.1f}")
        lines.append(f"| {name} |{p} {ours} | {dtxt} | {overlap} |")
    lines.append("")
    best_name = group_variant(best["group"]) or best["label"]
    base_name = group_variant(base["group"]) or base["label"]
    tied = [group_variant(r["group"]) or r["label"] for r in scored if r["mean"] == best["mean"]]
    summary = f"Best mean final accuracy: **{best_name}** ({_pct(best['mean'])}%)"
    if len(tied) > 1:
        summary = f"Best mean final accuracy: a tie at {_pct(best['mean'])}% between {', '.join(tied)}."
    elif best is not base:
        d, dh, _ = diffs[id(best)]
        if math.isnan(dh):
            summary += (f", {100 * d:+.1f} pp over the baseline {base_name}; with one seed per row there is no "
                        "confidence interval, so this ordering is not evidence of a difference.")
        elif abs(d) <= dh:
            summary += (f", {100 * d:+.1f} ± {100 * dh:.1f} pp over the baseline {base_name}: the 95% CI of the "
                        "difference includes 0, so at this scale and seed count we cannot tell them apart.")
        else:
            summary += f", {100 * d:+.1f} ± {100 * dh:.1f} pp over the baseline {base_name} (CI excludes 0)."
    else:
        summary += " — the baseline itself."
    numeric = {}
    for k, v in paper.items():
        try:
            numeric[k] = float(str(v).split()[0].rstrip("%"))
        except ValueError:
            pass
    if numeric:
        paper_best = max(numeric, key=numeric.get)
        agree = "is a tie" if len(tied) > 1 else ("agrees" if paper_best == best_name else "differs")
        summary += f" The paper's best row is **{paper_best}**; our best {agree}."
    if spec.cumulative and multi:
        steps = []
        for prev, cur in zip(scored, scored[1:]):
            d, dh, _ = difference(cur, prev)
            steps.append(f"{group_variant(prev['group'])} → {group_variant(cur['group'])} "
                         f"{100 * d:+.1f} ± {100 * dh:.1f}")
        summary += " Step-by-step change along the ladder (pp vs the previous rung): " + "; ".join(steps) + "."
    if not multi:
        summary += " (Some rows have a single completed seed: read differences as anecdotes.)"
    lines.append(summary)
    return "\n".join(lines), {"best": best_name, "baseline": base_name,
                              "rows": {group_variant(r["group"]) or r["label"]: r["mean"] for r in scored},
                              "diff_vs_baseline": {group_variant(r["group"]) or r["label"]: diffs[id(r)][:2]
                                                   for r in scored if r is not base},
                              "max_diff_half_width": max(halves) if halves else None}


def legend(plan: Plan) -> str:
    if not plan.variants:
        return ""
    lines = ["<details><summary>Variants (overrides of each row" + (", cumulative" if plan.spec.cumulative else "")
             + ")</summary>", "", "| Variant | Overrides |", "|---|---|"]
    for v, ov in plan.variants:
        own = v.full_overrides if plan.scale == "full" and v.full_overrides is not None else v.overrides
        shown = ("+ " if plan.spec.cumulative and v is not plan.variants[0][0] else "") + (
            " ".join(f"`{o}`" for o in own) or "(none)")
        lines.append(f"| {v.name} | {shown} |")
    if plan.spec.sft_control:
        lines.append(f"| sft_control | continued SFT from the same warm-up checkpoint for the wall time of "
                     f"`{plan.spec.sft_control.match}` (scripts/sft_control.py) |")
    lines += ["", "</details>"]
    return "\n".join(lines)


def build(plan: Plan, *, header_extra: dict[str, str], launch_notes: list[str]) -> dict:
    spec = plan.spec
    runs = load_runs([plan.runs_dir])
    # Rows differ by variant and sweep keys only; everything else every job shares (a spelling
    # difference in a shared override must not split a row).
    ignore = sorted({override_key(o) for o in plan.base} | {"logger.group"})
    groups, keys = group_runs(runs, group_by=spec.group_by, ignore=ignore)
    found, numbers = findings(spec, groups, keys)
    notes = [f"**What the paper found.** {spec.paper_finding}", "", found]
    if spec.notes:
        notes += ["", f"**Setup and budget.** {spec.notes}"]
    if launch_notes:
        notes += ["", "**Launch notes.**", ""] + [f"- {n}" for n in launch_notes]
    lg = legend(plan)
    if lg:
        notes += ["", lg]
    header = {"notes": "\n".join(notes), **header_extra}
    title = spec.title + (" (SMOKE: tiny budgets, one seed; not a result)" if plan.smoke else "")
    result = build_report([plan.runs_dir], plan.out, group_by=spec.group_by, target=spec.target, x=spec.x,
                          title=title, header=header, columns=spec.columns, ignore=ignore)
    result["findings"] = numbers
    (plan.out.parent / f"{plan.out.name}_findings.json").write_text(json.dumps(numbers, indent=2, default=str))
    return result
