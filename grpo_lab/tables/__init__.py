"""Paper tables: conf/table/<name>.yaml -> one Hydra multirun -> tables/<name>.md|csv|png.

Modules, in the order a table is made:
  spec         the typed schema of conf/table/*.yaml (ConfigStore) and `load_spec` with clear errors
  plan         jobs, variant config files, the multirun command, `preflight` (compose + validate all jobs)
  launch       running the multirun and the SFT controls, continuing a stopped launch, the machine
               description, dead jobs
  state        each run's state from disk (done / running / interrupted / failed / to do), the launch in
               progress, `make table-status`
  sft_control  the matched-compute SFT control row (the warm-up's SFT loop for the RL runs' step time)
  findings     "what we found" (Welch CIs from grpo_lab.report.stats), the legend, `build` (the table)
  record       the table's committed record, restored in a checkout without its runs
scripts/make_table.py is the command line over these.
"""

from grpo_lab.tables.plan import Plan, make_plan, preflight
from grpo_lab.tables.spec import SFTControl, TableSpec, TableSpecError, Variant, load_spec

__all__ = ["Plan", "SFTControl", "TableSpec", "TableSpecError", "Variant", "load_spec", "make_plan", "preflight"]
