"""Findings: what we found, computed from the runs, next to what the paper found; the variants'
legend; and `build`, which writes the table (markdown, CSV, PNG) with these in its header."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from grpo_lab.report import (build_report, contrast_ci, group_runs, load_runs, mean_ci, paired_diff_ci, t_ppf,
                             welch_diff_ci)
from grpo_lab.report.stats import seeds_for_half_width
from grpo_lab.report.table import ACC, SAMPLED_ACC, Context, column_value, final_value, format_pm, resolve_column
from grpo_lab.tables.record import write_meta
from grpo_lab.tables.plan import Plan
from grpo_lab.tables.spec import VARIANT_GROUP, Contrast, TableSpec, override_key, parse_expect, selector_terms
from grpo_lab.tables.state import compute_time_s, mean_host_load


# The resolution a lab table aims for: a paired Δ known to ±2.5 points (95 %), so that a 5-point effect shows.
TARGET_HALF_WIDTH = 0.025


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


def selects(selector: str, group) -> bool:
    """Whether a row selector (as `baseline` and `paper_direction` keys: a variant name or key=value,
    several space-separated terms all matching) picks this row."""
    return all(group.values.get(k) == v if v is not None else group_variant(group) == k
               for k, v in selector_terms(selector))


def paper_direction(spec: TableSpec, group, base_group, paper: dict) -> str | None:
    """better | worse | same: what the paper claims for this row against the baseline row. An explicit
    `paper_direction` entry wins; else the row's numeric `paper` value against the baseline's (the
    tables' paper metrics are accuracies: higher is better); None when the paper says nothing."""
    for sel, direction in spec.paper_direction.items():
        if selects(sel, group):
            return direction
    mine, theirs = _number(paper.get(group_variant(group) or "")), _number(paper.get(group_variant(base_group) or ""))
    if mine is None or theirs is None:
        return None
    return "better" if mine > theirs else "worse" if mine < theirs else "same"


def _number(text) -> float | None:
    try:
        return float(str(text).split()[0].rstrip("%"))
    except (ValueError, IndexError):
        return None


def direction_verdict(direction: str, d: float, half: float) -> str:
    """Does Δ ± half (row − baseline, 95% CI) reproduce the paper's direction?
    better/worse: "reproduced" when the whole interval lies on the paper's side of 0, "contradicted"
    when it lies wholly on the other side, else "unresolved" with the side Δ itself falls on.
    same (the paper found no difference): "consistent" when the interval includes 0, else "contradicted"."""
    if math.isnan(d):
        return "–"
    if math.isnan(half):
        return "n/a (one seed)"
    low, high = d - half, d + half
    if direction == "same":
        return "consistent" if low <= 0 <= high else "contradicted"
    # Flip a "worse" claim into a "better" one on −Δ: the interval is then [−high, −low].
    sign = 1 if direction == "better" else -1
    low, high = (low, high) if sign > 0 else (-high, -low)
    if low > 0:
        return "reproduced"
    if high < 0:
        return "contradicted"
    return "unresolved, " + ("paper's side" if sign * d > 0 else "other side" if sign * d < 0 else "Δ = 0")


def findings(spec: TableSpec, groups: list, keys: list[str], within: list[str] | None = None) -> tuple[str, dict]:
    """Markdown "what we found" computed from the groups, and the numbers behind it; with `within`
    (the block keys this scale sweeps, spec.within by default, e.g. [task]) one such section per
    block, each row compared with its own block's baseline."""
    within = spec.within if within is None else within
    if not within:
        return block_findings(spec, groups, keys)
    blocks: dict[str, list] = {}
    for g in groups:
        blocks.setdefault(" ".join(f"{k}={block_value(g, k)}" for k in within), []).append(g)
    texts, numbers = [], {"blocks": {}, "rows": {}}
    for name, block in blocks.items():
        text, found = block_findings(spec, block, keys)
        texts.append(f"*{name}*\n\n{text}")
        numbers["blocks"][name] = found
        numbers["rows"].update({f"{name} {row}": acc for row, acc in found.get("rows", {}).items()})
    return "\n\n".join(texts), numbers


def block_value(group, key: str) -> str | None:
    """The group's value of a block key: its grouping value, or (a key every run shares, so not a
    grouping key) the runs' common override. A group whose runs disagree would pair one block's
    seed with another's (a pinned sweep key once merged the two tasks of the DAPO ladder)."""
    if key in group.values:
        return group.values[key]
    values = {run.override_map.get(key) for run in group.runs}
    if len(values) > 1:
        raise ValueError(f"row {group.label!r} holds runs of different {key}={sorted(map(str, values))}: "
                         f"{key} must be a grouping key of the table")
    return values.pop() if values else None


@dataclass
class _Block:
    """The comparisons of one block: its rows, the scored ones (a completed seed or more), the baseline
    and best row, and each other row's Δ to the baseline (greedy, mean@k) and the paper's direction."""
    spec: TableSpec
    rows: list[dict]
    scored: list[dict]
    paper: dict
    base: dict
    best: dict
    multi: bool
    diffs: dict
    with_sampled: bool
    sampled_diffs: dict
    directions: dict
    halves: list[float]
    seeds_needed: int | None
    seeds_run: int

    @property
    def with_direction(self) -> bool:
        return any(self.directions.values())


def _block_rows(groups: list) -> list[dict]:
    """Per group: the final greedy accuracy (and mean@k, where measured) of each completed seed."""
    rows = []
    for g in groups:
        by_seed = {r.seed: v for r in g.runs_for_stats() if (v := final_value(r, ACC)) is not None}
        sampled = {r.seed: v for r in g.runs_for_stats() if (v := final_value(r, SAMPLED_ACC)) is not None}
        accs = list(by_seed.values())
        mean, half, n = mean_ci(accs)
        rows.append({"group": g, "label": g.label, "accs": accs, "by_seed": by_seed, "mean": mean, "half": half,
                     "n": n, "sampled": {"accs": list(sampled.values()), "by_seed": sampled}})
    return rows


def _compare(spec: TableSpec, rows: list[dict], scored: list[dict]) -> _Block:
    paper = {v.name: v.paper for v in spec.variants if v.paper is not None}
    if spec.sft_control and spec.sft_control.paper:
        paper["sft_control"] = spec.sft_control.paper
    base = next((r for r in scored if spec.baseline is not None and selects(spec.baseline, r["group"])), scored[0])
    diffs = {id(r): difference(r, base) for r in scored if r is not base}
    # mean@k at the rollout temperature, where the runs measured it (trainer.eval_sampled_k > 0)
    sampled_diffs = {id(r): difference(r["sampled"], base["sampled"]) for r in scored
                     if r is not base and r["sampled"]["accs"] and base["sampled"]["accs"]}
    # Seeds that would bring every paired Δ of this block to ±TARGET_HALF_WIDTH, at the spread observed
    # (sd of the per-seed differences = half·√n / t_{n−1}).
    needed = [seeds_for_half_width(dh * math.sqrt(n) / t_ppf(0.975, n - 1), TARGET_HALF_WIDTH)
              for _, dh, n in (paired_diff_ci(r["by_seed"], base["by_seed"]) for r in scored if r is not base)
              if n >= 2]
    return _Block(
        spec=spec, rows=rows, scored=scored, paper=paper, base=base, best=max(scored, key=lambda r: r["mean"]),
        multi=all(r["n"] >= 2 for r in scored), diffs=diffs,
        with_sampled=any(r["sampled"]["accs"] for r in scored), sampled_diffs=sampled_diffs,
        directions={id(r): paper_direction(spec, r["group"], base["group"], paper) for r in scored if r is not base},
        halves=[dh for _, dh, _ in diffs.values() if not math.isnan(dh)],
        seeds_needed=None if not needed or None in needed else max(needed),
        seeds_run=max(r["n"] for r in scored))


def _table_head(b: _Block) -> list[str]:
    """The sentence that says how the numbers were computed, and the table's header lines."""
    how = sorted({k for _, _, k in b.diffs.values()})
    lines = ["**What we found** (computed from the runs below: final greedy held-out accuracy, mean ± 95% CI "
             "over completed seeds; Δ = difference to the baseline row, "
             + ("paired by seed" if how == ["paired"] else "/".join(how) or "none") + ", with its 95% CI"
             + (f"; widest Δ half-width in this table: **{100 * max(b.halves):.1f} pp**" if b.halves else "")
             + (f"; seeds for ±{100 * TARGET_HALF_WIDTH:.1f} pp on every row at the spread observed: "
                f"**{b.seeds_needed}** (ran {b.seeds_run})" if b.seeds_needed else "") + "):", ""]
    with_paper, with_sampled, with_direction = bool(b.paper), b.with_sampled, b.with_direction
    head = ("| Row |" + ((" Paper" + (f" ({b.spec.paper_metric})" if b.spec.paper_metric else "") + " |")
                         if with_paper else "") + " Ours: final acc. (%) | Δ vs baseline (pp) |"
            + (" Ours: final mean@k (%) | Δ mean@k (pp) |" if with_sampled else "")
            + (" Paper's direction | Ours reproduces it? (greedy" + ("; mean@k" if with_sampled else "") + ") |"
               if with_direction else ""))
    return lines + [head, "|---|" + ("---:|" if with_paper else "") + "---:|---:|"
                    + ("---:|---:|" if with_sampled else "") + ("---|---|" if with_direction else "")]


def _table_line(b: _Block, r: dict, verdicts: dict[str, dict]) -> str:
    """Row ``r``'s table line; its verdict on the paper's direction goes into ``verdicts``."""
    with_sampled, with_direction = b.with_sampled, b.with_direction
    name = group_variant(r["group"]) or r["label"]
    p = f" {b.paper.get(group_variant(r['group']) or '', '–')} |" if b.paper else ""
    empty = " – |" * ((2 if with_sampled else 0) + (2 if with_direction else 0))
    if r["n"] == 0:
        return f"| {name} |{p} – (no completed run) | – |{empty}"
    ours = _mean_text(r["accs"])
    sampled = f" {_mean_text(r['sampled']['accs'])} |" if with_sampled else ""
    if r is b.base:
        return (f"| {name} (baseline) |{p} {ours} | 0 |" + (f"{sampled} 0 |" if with_sampled else "")
                + (" – | – |" if with_direction else ""))
    dtxt = _diff_text(*b.diffs[id(r)][:2])
    if with_sampled:
        sampled += f" {_diff_text(*b.sampled_diffs[id(r)][:2]) if id(r) in b.sampled_diffs else '–'} |"
    direction, verdict = b.directions[id(r)], ""
    if with_direction:
        said = [direction_verdict(direction, *b.diffs[id(r)][:2])] if direction else []
        if direction and with_sampled:
            said.append(direction_verdict(direction, *b.sampled_diffs[id(r)][:2]) if id(r) in b.sampled_diffs
                        else "–")
        if direction:
            verdicts[name] = dict(zip(("paper", "greedy", "sampled"), [direction, *said]))
        verdict = f" {direction or '–'} | {'; '.join(said) or '–'} |"
    return f"| {name} |{p} {ours} | {dtxt} |{sampled}{verdict}"


def _best_sentence(b: _Block, tied: list[str], best_name: str, base_name: str) -> str:
    """The best row, and whether its lead over the baseline is evidence of a difference."""
    best, base = b.best, b.base
    summary = f"Best mean final accuracy: **{best_name}** ({_pct(best['mean'])}%)"
    if len(tied) > 1:
        return f"Best mean final accuracy: a tie at {_pct(best['mean'])}% between {', '.join(tied)}."
    if best is base:
        return summary + " — the baseline itself."
    d, dh, _ = b.diffs[id(best)]
    if math.isnan(dh):
        return summary + (f", {100 * d:+.1f} pp over the baseline {base_name}; with one seed per row there is no "
                          "confidence interval, so this ordering is not evidence of a difference.")
    if abs(d) <= dh:
        return summary + (f", {100 * d:+.1f} ± {100 * dh:.1f} pp over the baseline {base_name}: the 95% CI of the "
                          "difference includes 0, so at this scale and seed count we cannot tell them apart.")
    return summary + f", {100 * d:+.1f} ± {100 * dh:.1f} pp over the baseline {base_name} (CI excludes 0)."


def _summary(b: _Block, verdicts: dict[str, dict], best_name: str, base_name: str) -> str:
    """The closing paragraph: best row, the paper's best row, the ladder's steps, caveats, directions."""
    tied = [group_variant(r["group"]) or r["label"] for r in b.scored if r["mean"] == b.best["mean"]]
    summary = _best_sentence(b, tied, best_name, base_name)
    numeric = {k: x for k, v in b.paper.items() if (x := _number(v)) is not None}
    if numeric:
        paper_best = max(numeric, key=numeric.get)
        agree = "is a tie" if len(tied) > 1 else ("agrees" if paper_best == best_name else "differs")
        summary += f" The paper's best row is **{paper_best}**; our best {agree}."
    if b.spec.cumulative and b.multi:
        steps = []
        for prev, cur in zip(b.scored, b.scored[1:]):
            d, dh, _ = difference(cur, prev)
            steps.append(f"{group_variant(prev['group'])} → {group_variant(cur['group'])} "
                         f"{100 * d:+.1f} ± {100 * dh:.1f}")
        summary += " Step-by-step change along the ladder (pp vs the previous rung): " + "; ".join(steps) + "."
    if not b.multi:
        summary += " (Some rows have a single completed seed: read differences as anecdotes.)"
    if verdicts:
        summary += " " + direction_summary(verdicts)
    return summary


def block_findings(spec: TableSpec, groups: list, keys: list[str]) -> tuple[str, dict]:
    """One comparison: every row of `groups` against the baseline row among them."""
    rows = _block_rows(groups)
    scored = [r for r in rows if r["n"] > 0]
    if not scored:
        return ("**What we found:** no run completed, so there is nothing to compare (see the failed runs "
                "below).", {"best": None})
    b = _compare(spec, rows, scored)
    verdicts: dict[str, dict] = {}
    lines = _table_head(b) + [_table_line(b, r, verdicts) for r in rows] + [""]
    best_name = group_variant(b.best["group"]) or b.best["label"]
    base_name = group_variant(b.base["group"]) or b.base["label"]
    lines.append(_summary(b, verdicts, best_name, base_name))
    return "\n".join(lines), {"best": best_name, "baseline": base_name,
                              "rows": {group_variant(r["group"]) or r["label"]: r["mean"] for r in scored},
                              "diff_vs_baseline": {group_variant(r["group"]) or r["label"]: b.diffs[id(r)][:2]
                                                   for r in scored if r is not b.base},
                              "max_diff_half_width": max(b.halves) if b.halves else None,
                              "seeds_for_target_half_width": b.seeds_needed,
                              "seeds_run": b.seeds_run,
                              "paper_direction": verdicts}


def threshold_verdict(expect: str, mean: float, half: float) -> str:
    """Does mean ± half (95 % CI) lie on the claimed side of `expect`'s threshold ('> 0', '< -0.05')?
    "reproduced" when wholly on it, "contradicted" when wholly on the other side, else "not resolved"."""
    op, threshold = parse_expect(expect)
    if math.isnan(mean):
        return "–"
    if math.isnan(half):
        return "n/a (one seed)"
    low, high = mean - half, mean + half
    claimed, other = (low > threshold, high < threshold) if op == ">" else (high < threshold, low > threshold)
    return "reproduced" if claimed else "contradicted" if other else "not resolved"


def _contrast_terms(c: Contrast, rows: list[dict], ctx: Context) -> dict[str, dict]:
    """Per selector of the contrast (its terms and `relative_to`): {seed: value} of the one row it selects, the
    row's final greedy accuracy or, with `column`, that column's value of each of its completed runs."""
    column = resolve_column(c.column) if c.column else None
    out = {}
    for sel in [*c.terms, *([c.relative_to] if c.relative_to else [])]:
        matched = [r for r in rows if selects(sel, r["group"])]
        if len(matched) != 1:
            out[sel] = {}
        elif column is None:
            out[sel] = matched[0]["by_seed"]
        else:
            out[sel] = {run.seed: v for run in matched[0]["group"].runs_for_stats()
                        if (v := column_value(column, run, ctx)) is not None}
    return out


def contrast_findings(contrasts: list[Contrast], groups: list, ctx: Context | None = None) -> tuple[str, dict]:
    """The table's cross-block claims (spec `contrasts`): each one's per-seed contrast of final greedy
    accuracies (or of the column it names), its 95 % interval and verdict, as a Markdown table and the
    numbers behind it. `ctx`: the table's target and x axis, which first-reach columns read."""
    if not contrasts:
        return "", {}
    rows, ctx = _block_rows(groups), ctx or Context()
    of_what = ("final greedy accuracies, or of the column named" if any(c.column for c in contrasts)
               else "final greedy accuracies")
    lines = [f"**Claims across rows** (per seed, the contrast of {of_what}; mean ± 95 % CI over the "
             "seeds every term completed; in points, or in % of the reference row's accuracy where relative):", "",
             "| claim | contrast | ours | expected | verdict |", "|---|---|---|---|---|"]
    numbers = {}
    for c in contrasts:
        by_selector = _contrast_terms(c, rows, ctx)
        mean, half, n = contrast_ci(by_selector, dict(c.terms), by_selector.get(c.relative_to) if c.relative_to else None)
        verdict = threshold_verdict(c.expect, mean, half)
        formula = " ".join(f"{'+' if k > 0 else '−'} {abs(k):g}·[{sel}]" for sel, k in c.terms.items()).lstrip("+ ")
        if c.relative_to:
            formula = f"({formula}) / [{c.relative_to}]"
        op, threshold = parse_expect(c.expect)
        fmt = resolve_column(c.column).fmt if c.column else "pp"
        if fmt in ("pct", "pp") or c.relative_to:
            ours, expected = _diff_text(mean, half), f"{op} {100 * threshold:+g}"
        else:   # a count (steps) or a plain number, in its own unit
            ours = ("+" if mean >= 0 else "") + format_pm(mean, half, fmt) if not math.isnan(mean) else "nan"
            expected = f"{op} {threshold:+g}"
        of = f"{c.column} of " if c.column else ""
        lines.append(f"| {c.claim or c.name} | {c.name}: {of}{formula} | {ours} (n={n}) | {expected} | {verdict} |")
        numbers[c.name] = {"mean": mean, "half_width": half, "seeds": n, "expect": c.expect, "verdict": verdict,
                           **({"column": c.column} if c.column else {})}
    return "\n".join(lines), numbers


def _mean_text(values: list[float]) -> str:
    mean, half, n = mean_ci(values)
    return f"{_pct(mean)} ± {_pct(half) if n > 1 else 'n/a'} (n={n})" if n else "–"


def _diff_text(d: float, half: float) -> str:
    return f"{100 * d:+.1f}" + ("" if math.isnan(half) else f" ± {100 * half:.1f}")


def direction_summary(verdicts: dict[str, dict]) -> str:
    """One sentence: on how many rows with a paper direction ours reproduces it, per metric."""
    parts = []
    for metric, label in (("greedy", "greedy accuracy"), ("sampled", "mean@k")):
        said = [v[metric] for v in verdicts.values() if metric in v]
        if not said:
            continue
        counts = {k: sum(s.startswith(k) for s in said) for k in ("reproduced", "consistent", "contradicted",
                                                                  "unresolved")}
        parts.append(f"{label}: " + ", ".join(f"{k} {n}" for k, n in counts.items() if n) + f" of {len(said)}")
    return ("The paper's direction (95% CI of the paired Δ wholly on its side = reproduced; wholly on the "
            "other side = contradicted; a \"same\" claim is consistent when the CI includes 0) — "
            + "; ".join(parts) + ".")


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


def record_run_times(plan: Plan, runs: list) -> None:
    """Each run's wall time, its own compute (the sum of its step times) and the machine's mean load over
    its steps into table_meta.json's `run_times`, keyed by the run's path under the runs directory, so
    that runs made at different times (before and after a stop, alone or beside other jobs) compare by
    what they computed and say in which conditions. A resumed run's wall time counts
    the time it ran (train.py carries it over in the checkpoint), not the time it was stopped. A run
    restored from the table's record has no metrics: its entry stays as recorded."""
    meta_path = plan.runs_dir / "table_meta.json"
    if not meta_path.exists():
        return
    meta = json.loads(meta_path.read_text())
    times = dict(meta.get("run_times", {}))
    for r in runs:
        if r.recorded is not None:
            continue
        summary = r.summary or {}
        times[r.path.relative_to(plan.runs_dir).as_posix()] = {
            "status": r.status, "wall_time_s": summary.get("wall_time_s"), "compute_time_s": compute_time_s(r.metrics),
            "mean_host_load_1m": mean_host_load(r.metrics), "resumed": bool(summary.get("resumed_from"))}
    meta_path.write_text(json.dumps({**meta, "run_times": times}, indent=2))


def build(plan: Plan, *, header_extra: dict[str, str], launch_notes: list[str]) -> dict:
    spec = plan.spec
    runs = load_runs([plan.runs_dir])
    # Rows differ by variant and sweep keys only; everything else every job shares (a spelling
    # difference in a shared override must not split a row). A sweep key one launch pinned
    # (`--add-seeds 9 -- task=partial_sums`) still tells the table's rows apart.
    swept = {override_key(k) for k in spec.sweep}
    ignore = sorted({override_key(o) for o in plan.base} - swept | {"logger.group"})
    groups, keys = group_runs(runs, group_by=spec.group_by, ignore=ignore)
    found, numbers = findings(spec, groups, keys, within=plan.block_keys)
    notes = [f"**What the paper found.** {spec.paper_finding}", "", found]
    claims, contrasts = contrast_findings(spec.contrasts, groups, Context(target=spec.target, x=spec.x))
    if claims:
        notes += ["", claims]
        numbers["contrasts"] = contrasts
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
    record_run_times(plan, runs)
    # With the runs CSV just written, the table's committed record: a fresh checkout can extend it.
    result["meta"] = write_meta(plan)
    return result
