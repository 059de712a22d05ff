"""The package's layers: every import in grpo_lab/ points down the floors declared in FLOORS.

A module may import modules on its own floor or on a floor below it, never one above, and the imports
within a floor must not form a cycle; so the whole import graph is acyclic and a module can be read,
tested and changed knowing only what lies beneath it. Imports inside functions count like module-level
ones (a lazy import is still a dependency, only a later one), relative imports are resolved, and
importing ``a.b.c`` also runs the package ``a.b``'s ``__init__`` (so that package counts as imported).

FLOORS is the one declaration of the layering. A module belongs to the floor of the longest prefix in
it that matches its dotted name, so a new file in ``grpo_lab/rollout/`` is on rollout's floor without
an entry of its own; a new top-level module must be placed here. Run
``python tests/test_layers.py path/to/grpo_lab`` to list the violations of another checkout.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = "grpo_lab"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE

# Bottom to top: (floor name, module prefixes). The package's own __init__ is on the bottom floor.
FLOORS: list[tuple[str, list[str]]] = [
    ("foundation", ["grpo_lab.schema", "grpo_lab.registry", "grpo_lab.atomic_dir", "grpo_lab.parent_death",
                    "grpo_lab.progress", "grpo_lab.cache"]),
    ("math and prompts", ["grpo_lab.algos", "grpo_lab.prompts"]),
    ("learner tensors", ["grpo_lab.learner"]),           # batch, schedules, torch.distributed helpers
    ("models", ["grpo_lab.models"]),
    ("rollout", ["grpo_lab.rollout"]),
    ("rewards", ["grpo_lab.rewards"]),                   # the LLM judge builds a model and an engine
    ("tasks", ["grpo_lab.tasks"]),
    ("interaction", ["grpo_lab.interaction"]),           # multi-turn environments and rollouts
    ("loop phases", ["grpo_lab.evaluation", "grpo_lab.sampling"]),
    ("objectives", ["grpo_lab.objectives"]),
    ("learner", ["grpo_lab.learner.learner"]),
    ("plans and checks", ["grpo_lab.memory_plan", "grpo_lab.validation_io", "grpo_lab.cpu_placement",
                          "grpo_lab.config_reads"]),
    ("run services", ["grpo_lab.backends", "grpo_lab.ray_backend", "grpo_lab.warmup", "grpo_lab.checkpoint",
                      "grpo_lab.resume", "grpo_lab.logging", "grpo_lab.run_setup", "grpo_lab.run_guard"]),
    # Models other than the policy (the critic LLM, reward models) are built and warmed up like the policy,
    # so they sit above the run services; grpo_lab.config imports them, which registers the critic LLM.
    ("second models", ["grpo_lab.second_models"]),
    ("config", ["grpo_lab.config", "grpo_lab.name_index"]),   # name_index: the registries' names, for launch
    ("launch", ["grpo_lab.launch"]),                     # Hydra, run directory, resume, refusal; given the loop
    ("entry point", ["grpo_lab.train", "grpo_lab.train_reward_model"]),
    ("report", ["grpo_lab.report"]),
    ("tables", ["grpo_lab.tables"]),
]


@dataclass(frozen=True)
class Import:
    source: str      # importing module
    path: Path       # its file
    line: int
    target: str      # imported module (or package whose __init__ runs)


def module_files(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under the package directory `root`."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = [root.name, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _existing(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of `name` that is a module of the package (``a.b.func`` -> ``a.b``)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _with_packages(source: str, target: str, modules: dict[str, Path]) -> list[str]:
    """`target` and the packages whose __init__ importing it runs, except the importer's own packages."""
    parts = target.split(".")
    names = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    return [n for n in names if n in modules and n != source and not source.startswith(n + ".")]


def imports(root: Path) -> list[Import]:
    """Every import of a package module in the package under `root`, at any depth of the syntax tree."""
    modules = module_files(root)
    found = []
    for source, path in modules.items():
        package = source if path.name == "__init__.py" else source.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                names = [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            targets = {_existing(n, modules) for n in names if n == root.name or n.startswith(root.name + ".")}
            for target in sorted(t for t in targets if t):
                found += [Import(source, path, node.lineno, t) for t in _with_packages(source, target, modules)]
    return found


def floor_of(module: str) -> int | None:
    """Index in FLOORS of the floor whose longest prefix matches `module`; None when no prefix does."""
    if module == PACKAGE:
        return 0
    best = max(((len(p), i) for i, (_, prefixes) in enumerate(FLOORS) for p in prefixes
                if module == p or module.startswith(p + ".")), default=None)
    return None if best is None else best[1]


def _cycles(edges: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, stack, on_stack, out, counter = {}, {}, [], set(), [], [0]
    for start in list(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        out.append(component)
            elif child not in index:
                index[child] = low[child] = counter[0]
                counter[0] += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(edges[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return out


def violations(root: Path) -> list[str]:
    """One message per module on no floor, per import that points up, and per import inside a cycle
    on one floor; each names the importing file, the line and the floors."""
    base = root.parent
    out = [f"{path.relative_to(base)}: module {name} is on no floor; add its prefix to FLOORS in {Path(__file__).name}"
           for name, path in module_files(root).items() if floor_of(name) is None]
    same_floor: dict[str, set[str]] = defaultdict(set)
    found = [i for i in imports(root) if floor_of(i.source) is not None and floor_of(i.target) is not None]
    for imp in found:
        low, high = floor_of(imp.source), floor_of(imp.target)
        if high > low:
            out.append(f"{imp.path.relative_to(base)}:{imp.line}: {imp.source} (floor {low} '{FLOORS[low][0]}') "
                       f"imports {imp.target} on a higher floor ({high} '{FLOORS[high][0]}')")
        elif high == low:
            same_floor[imp.source].add(imp.target)
    for component in _cycles(same_floor):
        floor = floor_of(next(iter(component)))
        for imp in found:
            if imp.source in component and imp.target in component:
                out.append(f"{imp.path.relative_to(base)}:{imp.line}: {imp.source} imports {imp.target}, both on "
                           f"floor {floor} '{FLOORS[floor][0]}', in the import cycle {sorted(component)}")
    return out


def test_imports_point_down():
    problems = violations(ROOT)
    assert not problems, "imports against the layering (tests/test_layers.py FLOORS):\n" + "\n".join(problems)


def folder_of(module: str) -> str:
    """The package folder (or top-level module) a module belongs to: grpo_lab.learner.batch -> grpo_lab.learner."""
    return ".".join(module.split(".")[:2])


def folder_cycles(root: Path) -> list[set[str]]:
    """Folders (subpackages and top-level modules) that import each other in a circle, read as whole rooms:
    e.g. a file of interaction/ importing the set-up that imports interaction/ makes interaction/ and the
    set-up one circle even when no single module does."""
    edges: dict[str, set[str]] = defaultdict(set)
    for imp in imports(root):
        a, b = folder_of(imp.source), folder_of(imp.target)
        if a != b and a != PACKAGE and b != PACKAGE:
            edges[a].add(b)
        edges.setdefault(b, set())
    return _cycles(edges)


def test_folders_do_not_import_each_other_in_a_circle():
    """A folder read as one room (learner/, interaction/, objectives/, ...) stands above everything it imports:
    no file of it reaches up into a module that imports the folder back."""
    circles = folder_cycles(ROOT)
    assert not circles, f"folders that import each other: {[sorted(c) for c in circles]}"


def test_a_folder_circle_is_found(tmp_path):
    root = _write(tmp_path, {"grpo_lab/__init__.py": "", "grpo_lab/setup.py": "import grpo_lab.env.base\n",
                             "grpo_lab/env/__init__.py": "", "grpo_lab/env/base.py": "",
                             "grpo_lab/env/critic.py": "from grpo_lab import setup\n"})
    assert [sorted(c) for c in folder_cycles(root)] == [["grpo_lab.env", "grpo_lab.setup"]]


def test_floors_are_declared_once():
    prefixes = [p for _, floor in FLOORS for p in floor]
    assert len(prefixes) == len(set(prefixes))
    assert all(p.startswith(PACKAGE + ".") for p in prefixes)


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root / PACKAGE


def test_reports_lazy_upward_imports_and_same_floor_cycles(tmp_path):
    """The checker itself: an import inside a function that points up, a relative import that does,
    and a cycle on one floor are each reported with file, line and floors; downward ones are not."""
    root = _write(tmp_path, {
        "grpo_lab/__init__.py": "",
        "grpo_lab/registry.py": "",
        "grpo_lab/schema.py": "import os\n\n\ndef f():\n    from grpo_lab.config import validate\n",
        "grpo_lab/config.py": "from grpo_lab.schema import x\nfrom grpo_lab import registry\n",
        "grpo_lab/rollout/__init__.py": "from .base import Rollout\n",
        "grpo_lab/rollout/base.py": "from . import hf\n",
        "grpo_lab/rollout/hf.py": "from .base import Rollout\nfrom ..train import run\n",
        "grpo_lab/train.py": "import grpo_lab.rollout.hf\n",
    })
    problems = violations(root)
    assert any(p.startswith("grpo_lab/schema.py:5: grpo_lab.schema (floor 0 'foundation') imports grpo_lab.config "
                            "on a higher floor") for p in problems), problems
    assert any(p.startswith("grpo_lab/rollout/hf.py:2: grpo_lab.rollout.hf (floor 4 'rollout') imports grpo_lab.train")
               for p in problems), problems
    cycle = [p for p in problems if "import cycle" in p]
    assert {p.split(":")[0] for p in cycle} == {"grpo_lab/rollout/base.py", "grpo_lab/rollout/hf.py"}, problems
    assert all("floor 4 'rollout'" in p for p in cycle)
    assert not any(p.startswith(("grpo_lab/config.py", "grpo_lab/train.py")) for p in problems), problems


def test_reports_modules_on_no_floor(tmp_path):
    root = _write(tmp_path, {"grpo_lab/__init__.py": "", "grpo_lab/stray.py": ""})
    assert violations(root) == [f"grpo_lab/stray.py: module grpo_lab.stray is on no floor; add its prefix to FLOORS "
                                f"in {Path(__file__).name}"]


@pytest.mark.parametrize("module, floor", [("grpo_lab", "foundation"), ("grpo_lab.learner.batch", "learner tensors"),
                                           ("grpo_lab.learner.learner", "learner"),
                                           ("grpo_lab.rollout.new_engine", "rollout")])
def test_longest_prefix_places_a_module(module, floor):
    assert FLOORS[floor_of(module)][0] == floor


if __name__ == "__main__":
    print("\n".join(violations(Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else ROOT)) or "no violations")
