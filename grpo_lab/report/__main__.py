"""CLI: python -m grpo_lab.report <sweep dir or glob> [more...] --out tables/name [options]

Prints the markdown table (and any failed runs) to stdout, writes <out>.md, <out>.csv,
<out>_runs.csv and <out>.png, and lists the written files on stderr.

Exit status: 0 on success, 2 when no run is found or an option is invalid (the message says
what to change).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from .build import build_report
from .runs import NoRunsFound
from .table import COLUMNS, failed_runs_markdown


def _csv_list(text: str | None) -> list[str] | None:
    if not text:
        return None
    return [t.strip() for t in text.split(",") if t.strip()]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m grpo_lab.report",
        description="Turn run directories into a paper table (markdown + CSV) and learning curves, "
        "with mean ± 95% CI over seeds. Reads only local files (wandb may be off).",
    )
    p.add_argument(
        "paths", nargs="+", help="sweep or run directories, or quoted globs (searched recursively)"
    )
    p.add_argument("--out", required=True, help="output stem: tables/x -> x.md, x.csv, x.png")
    p.add_argument(
        "--group-by", help="comma-separated dotted config keys (default: varying overrides but seed)"
    )
    p.add_argument("--ignore", help="comma-separated override keys to leave out of grouping")
    p.add_argument("--target", type=float, help="target accuracy as a fraction, e.g. 0.6")
    p.add_argument("--x", default="samples", choices=["samples", "step", "steps"], help="x axis")
    p.add_argument("--metric", default="eval/accuracy", help="metric to plot")
    p.add_argument(
        "--columns",
        help=f"comma-separated columns: {', '.join(COLUMNS)}, or <last|mean|max|min>:<metric>",
    )
    p.add_argument("--title", help="markdown title (default: the --out name)")
    p.add_argument("--command", help="command shown in the header (default: this command line)")
    p.add_argument("--machine", help="machine description for the header")
    p.add_argument("--notes-file", type=Path, help="file whose text goes under the header")
    p.add_argument(
        "--include-incomplete",
        action="store_true",
        help="also average runs without summary.json (e.g. a sweep still running)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)

    header = {"command": args.command or "python -m grpo_lab.report " + shlex.join(argv)}
    if args.machine:
        header["machine"] = args.machine
    if args.notes_file:
        try:
            header["notes"] = args.notes_file.read_text(encoding="utf-8")
        except OSError as e:
            print(f"error: cannot read --notes-file: {e}", file=sys.stderr)
            return 2

    try:
        result = build_report(
            args.paths,
            args.out,
            group_by=_csv_list(args.group_by),
            target=args.target,
            x=args.x,
            title=args.title,
            header=header,
            columns=_csv_list(args.columns),
            ignore=_csv_list(args.ignore) or (),
            metric=args.metric,
            include_incomplete=args.include_incomplete,
        )
    except NoRunsFound as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:  # bad column name, x or target: the message says what to change
        print(f"error: {e}", file=sys.stderr)
        return 2

    print(result["table"])
    failed = failed_runs_markdown(result["groups"], args.include_incomplete)
    if failed:
        print("\n" + failed)
    for key in ("md", "csv", "runs_csv", "png"):
        print(f"wrote {result[key]}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
