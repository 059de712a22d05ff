"""Peak resident memory of a command's whole process tree (the trainer and its engine processes).

    python scripts/peak_tree_rss.py -- make run-smollm2        # prints the peak GiB when the command ends

Samples grpo_lab.train.host_tree_rss_gib every --every seconds (default 2) until the command exits; exits
with the command's status. How README.md's SmolLM2 peak-memory figures were measured.
"""

import argparse
import subprocess
import sys
import time

import psutil

from grpo_lab.train import host_tree_rss_gib


def peak_while_running(proc: subprocess.Popen, every: float) -> float:
    """Peak resident GiB of `proc` and all its children, sampled every `every` seconds until it exits."""
    root, peak = psutil.Process(proc.pid), 0.0
    while proc.poll() is None:
        try:
            peak = max(peak, host_tree_rss_gib(root))
        except psutil.Error:   # the root ended between poll() and the read
            pass
        time.sleep(every)
    return peak


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--every", type=float, default=2.0, help="seconds between samples (default 2)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args()
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        parser.error("give the command to measure after --")
    proc = subprocess.Popen(cmd)
    peak = peak_while_running(proc, args.every)
    print(f"peak tree RSS {peak:.2f} GiB (sampled every {args.every:g} s): {' '.join(cmd)}", file=sys.stderr)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
