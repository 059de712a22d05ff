"""The lab notebook's list of committed tables (tables/README.md), generated from the tables themselves.

    python -m grpo_lab.tables.readme            # rewrite the block in tables/README.md (make readme-tables)
    python -m grpo_lab.tables.readme --check    # exit 1 when tables/README.md is out of date (what the test asks)

Each row comes from `tables/<name>.md` (title, command, wall time of every launch, the computed "Best
mean final accuracy" sentence of every block) and `tables/<name>_findings.json` (every row's mean final
accuracy, the widest paired-difference half-width, the seeds run and the seeds it would take to bring it
to ±2.5 pp), so the notebook says exactly what the table files say. The notebook sits beside the tables,
so each row links to its table file by name. `scripts/make_table.py` refreshes the block after writing a
table into the project's tables/ directory.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BEGIN = "<!-- tables:begin: generated from tables/*.md by `make readme-tables`; do not edit by hand -->"
END = "<!-- tables:end -->"
NOTEBOOK = "README.md"   # the lab notebook in tables/, which holds the block


def _short(row: str, block: str) -> str:
    """A row's label without the block's own settings: "task=chain_sum, clip_low=0.1" in block
    "task=chain_sum" -> "clip_low=0.1"."""
    own = set(block.split())
    return ", ".join(part for part in re.split(r",\s*|\s+", row) if part and part not in own) or row


def table_row(md: Path) -> str | None:
    """One README row for a table file, or None when it has no findings beside it (e.g. a SMOKE table).

    A table with blocks (one baseline per task, say) gets every block's numbers and finding, each led by
    the block's name, so no block is left out of the README."""
    findings_file = md.with_name(f"{md.stem}_findings.json")
    if not findings_file.is_file():
        return None
    text = md.read_text()
    findings = json.loads(findings_file.read_text())
    blocks = findings.get("blocks") or {"": findings}
    title = text.splitlines()[0].lstrip("# ").strip()
    command = re.search(r"\*\*Command:\*\* `([^`]*)`", text)
    date = re.search(r"^- \*\*Date:\*\*(.*)$", text, re.MULTILINE)
    walls = [float(w) for w in re.findall(r"wall time ([\d.]+) min", date.group(1))] if date else []
    # Each block's section of the table, from its `*task=gcd*` line to the next block's (one block: all of
    # it): a block with no completed run has no "Best mean" line, so the lines are found per section.
    starts = sorted((text.find(f"\n*{name}*\n"), name) for name in blocks if name)
    sections = {name: text[start:end] for (start, name), (end, _) in zip(starts, starts[1:] + [(len(text), "")])}

    def best(name: str) -> str | None:
        found = re.search(r"^(Best mean final accuracy.*?)$", sections.get(name, text), re.MULTILINE)
        return found.group(1) if found else None

    def lead(name: str) -> str:
        return f"*{name}*: " if name else ""

    means, widths, finding = [], [], []
    for name, block in blocks.items():
        means.append(lead(name) + ", ".join(f"{_short(row, name)} {100 * acc:.1f}"
                                            for row, acc in block.get("rows", {}).items()))
        half, needed = block.get("max_diff_half_width"), block.get("seeds_for_target_half_width")
        if half is not None:
            widths.append(lead(name) + f"{100 * half:.1f} pp ({block.get('seeds_run', '?')} seeds; {needed} for ±2.5)")
        if best(name):
            finding.append(lead(name) + best(name))
    wall = (f"{sum(walls):.1f} min" + (f" in {len(walls)} launches" if len(walls) > 1 else "")) if walls else "?"
    return (f"| [{md.stem}]({md.name}) | {title} | `{command.group(1) if command else '?'}` | {wall} | "
            f"{'; '.join(means)} % | {'; '.join(widths) or '–'} | {' '.join(finding)} |")


def render(tables_dir: Path) -> str:
    tables = sorted(md for md in tables_dir.glob("*.md") if md.name != NOTEBOOK)   # not the notebook itself
    rows = [r for r in (table_row(md) for md in tables) if r]
    return "\n".join([BEGIN, "", "| table | what | command | wall time | final greedy accuracy per row (mean over seeds) "
                      "| widest paired Δ 95 % half-width vs the baseline (seeds run; seeds for ±2.5 pp) "
                      "| finding (computed, with its interval) |", "|---|---|---|---|---|---|---|", *rows, "", END])


def updated(readme_text: str, tables_dir: Path) -> str:
    """The notebook's text with the block between BEGIN and END replaced by `render(tables_dir)`."""
    start, end = readme_text.find(BEGIN), readme_text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"the notebook has no generated tables block: put the lines\n{BEGIN}\n{END}\nwhere it belongs")
    return readme_text[:start] + render(tables_dir) + readme_text[end + len(END):]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 if the notebook is not what the tables say")
    p.add_argument("--readme", type=Path, default=REPO / "tables" / NOTEBOOK)
    p.add_argument("--tables", type=Path, default=REPO / "tables")
    args = p.parse_args(argv)
    old = args.readme.read_text()
    new = updated(old, args.tables)
    if args.check:
        if new != old:
            print(f"{args.readme} is out of date with {args.tables}: run `make readme-tables`", file=sys.stderr)
            return 1
        return 0
    if new != old:
        args.readme.write_text(new)
        print(f"updated the tables block of {args.readme}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
