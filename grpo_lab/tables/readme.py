"""The README's list of committed tables, generated from the tables themselves (never written by hand).

    python -m grpo_lab.tables.readme            # rewrite the block in README.md (make readme-tables)
    python -m grpo_lab.tables.readme --check    # exit 1 when README.md is out of date (what the test asks)

Each row comes from `tables/<name>.md` (title, command, wall time, the computed "Best mean final
accuracy" sentence) and `tables/<name>_findings.json` (every row's mean final accuracy), so the README
says exactly what the table files say. `scripts/make_table.py` refreshes the block after writing a
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


def table_row(md: Path) -> str | None:
    """One README row for a table file, or None when it has no findings beside it (e.g. a SMOKE table)."""
    findings = md.with_name(f"{md.stem}_findings.json")
    if not findings.is_file():
        return None
    text = md.read_text()
    title = text.splitlines()[0].lstrip("# ").strip()
    command = re.search(r"\*\*Command:\*\* `([^`]*)`", text)
    wall = re.search(r"wall time ([\d.]+ min)", text)
    best = re.search(r"^(Best mean final accuracy.*?)$", text, re.MULTILINE)
    rows = json.loads(findings.read_text()).get("rows", {})
    means = ", ".join(f"{name} {100 * acc:.1f}" for name, acc in rows.items())
    return (f"| [{md.stem}](tables/{md.name}) | {title} | `{command.group(1) if command else '?'}` | "
            f"{wall.group(1) if wall else '?'} | {means} % | {best.group(1) if best else ''} |")


def render(tables_dir: Path) -> str:
    rows = [r for r in (table_row(md) for md in sorted(tables_dir.glob("*.md"))) if r]
    return "\n".join([BEGIN, "", "| table | what | command | wall time | final greedy accuracy per row (mean over seeds) "
                      "| finding (computed, with its interval) |", "|---|---|---|---|---|---|", *rows, "", END])


def updated(readme_text: str, tables_dir: Path) -> str:
    """README text with the block between BEGIN and END replaced by `render(tables_dir)`."""
    start, end = readme_text.find(BEGIN), readme_text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"README has no generated tables block: put the lines\n{BEGIN}\n{END}\nwhere it belongs")
    return readme_text[:start] + render(tables_dir) + readme_text[end + len(END):]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 if README.md is not what the tables say")
    p.add_argument("--readme", type=Path, default=REPO / "README.md")
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
