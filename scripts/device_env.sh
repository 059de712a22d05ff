# Sourced by the scripts that run on the lent GPU machine (device_check.sh, device_costs.sh): installs the
# carried packages of .whl/ (scripts/device_wheels.sh fills it here) into /tmp/site, puts them and this
# checkout on PYTHONPATH, and builds SmolLM2-135M's architecture with seeded random weights at
# $random_model (the released weights cannot travel; see device_wheels.sh). Expects $py and run().
shape=.whl/smollm2_135m_shape
random_model=/tmp/smollm2_135m_random
run "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit
# Needs a C compiler and Python's headers there; without pycosat reasoning-gym does not import, and only
# the tests that build no task (learner, cuda_ipc) can pass: say so and go on.
run "$py" -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/site \
    .whl/pycosat-*.tar.gz || echo "device_env: pycosat did not build here; the tests that run a task will fail" >&2
export PYTHONPATH="/tmp/site:$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 WANDB_MODE=offline \
    TOKENIZERS_PARALLELISM=false VLLM_ALLOW_INSECURE_SERIALIZATION=1
# The machine's own python3 and its torchrun (test_fsdp.torchrun looks beside sys.executable).
export PATH="$(dirname "$(command -v "$py")"):$PATH"
# make_random_smollm2: SmolLM2-135M's shape with seeded random weights at $random_model.
make_random_smollm2() {
    [ -f "$random_model/config.json" ] && [ "$dry" != 1 ] && return 0
    run "$py" -c "import sys, torch; from transformers import AutoConfig, AutoModelForCausalLM; torch.manual_seed(0); \
AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(sys.argv[1])).save_pretrained(sys.argv[2])" \
        "$shape" "$random_model" && run cp "$shape"/* "$random_model"/
}
