#!/usr/bin/env python
"""Matched-compute SFT control (grpo_lab/tables/sft_control.py): continue the warm-up's SFT from the RL
runs' warm-up checkpoint for a wall-time budget, then evaluate as the RL runs do.

    python scripts/sft_control.py --wall-time 40 --run-dir outputs/x/sft_control_s0 -- seed=0 rollout=hf
"""

import sys

from grpo_lab.tables.sft_control import main

if __name__ == "__main__":
    sys.exit(main(prog="scripts/sft_control.py"))
