"""llama.cpp, built here: `llama-server` from the llama.cpp sources inside llama-cpp-python's PyPI
sdist, and the family's models converted to GGUF with that tree's own converter.

Everything lands in one folder (default: $AUTOTUNE_LLAMACPP_DIR, else ~/.cache/autotune/) and
each step is skipped when its output is there, so a second `setup` costs nothing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

# The newest release whose server still reads the per-request `speculative.n_max`, `n_min` and
# `p_min` fields (from 0.3.24 they are compiled out, and K is fixed per server).
LLAMA_CPP_PYTHON = "0.3.23"

# The converter identifies a BPE pre-tokenizer by hashing the tokens of a test string, and the
# family's tokenizer is not among the hashes it knows; for a Llama it also looks for a
# SentencePiece model first. The family's tokenizer is byte-level BPE with GPT-2's split pattern
# (`check_gpt2_pretokenizer` verifies it), so the converter is told so: GPT-2's vocabulary path,
# GPT-2's pre-tokenizer. Its sources stay as released.
_CONVERT = """
import sys
sys.path.insert(0, sys.argv.pop(1))
sys.argv[0] = "convert_hf_to_gguf.py"
import convert_hf_to_gguf as convert
convert.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
convert.LlamaModel.set_vocab = lambda self: self._set_vocab_gpt2()
convert.main()
"""


def default_dir() -> Path:
    return Path(os.environ.get("AUTOTUNE_LLAMACPP_DIR") or Path.home() / ".cache" / "autotune" /
                f"llamacpp-{LLAMA_CPP_PYTHON}")


@dataclass(frozen=True)
class LlamaCpp:
    """A folder holding llama.cpp's sources, its `llama-server` build and GGUF models."""

    root: Path

    @property
    def source(self) -> Path:
        return self.root / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"

    @property
    def server(self) -> Path:
        return self.root / "build" / "bin" / "llama-server"

    def gguf(self, model_dir: Path) -> Path:
        """Where `model_dir` converted lies: named by its folder and a digest of its files, so that a
        retrained model or another family's model of the same name is converted anew."""
        digest = hashlib.sha256()
        for path in sorted(Path(model_dir).iterdir()):
            if path.is_file():
                digest.update(path.name.encode() + b"\0" + path.read_bytes())
        return self.root / "gguf" / f"{Path(model_dir).name}-{digest.hexdigest()[:12]}.gguf"

    def fetch_sources(self) -> None:
        """Download the pinned sdist from the package index (pip's own configuration) and unpack it."""
        if (self.source / "CMakeLists.txt").exists():
            return
        self.root.mkdir(parents=True, exist_ok=True)
        logger.info("downloading llama-cpp-python %s (its sdist holds llama.cpp's sources)", LLAMA_CPP_PYTHON)
        _run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
              f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(self.root)])
        with tarfile.open(self.root / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz") as sdist:
            sdist.extractall(self.root, filter="data")

    def build_server(self, jobs: int | None = None) -> None:
        """cmake's Release build of the `llama-server` target alone, for this CPU, without the web
        UI (it would be downloaded), HTTPS or curl."""
        if self.server.exists():
            return
        self.fetch_sources()
        if shutil.which("cmake") is None:
            raise RuntimeError("building llama-server needs cmake (and a C++ compiler): apt-get install cmake g++")
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        build = self.root / "build"
        logger.info("building llama-server in %s (about 5 minutes on 2 cores)", build)
        _run(["cmake", "-S", str(self.source), "-B", str(build), *generator, "-DCMAKE_BUILD_TYPE=Release",
              "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
              "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF"])
        _run(["cmake", "--build", str(build), "--target", "llama-server", "-j", str(jobs or os.cpu_count() or 1)])

    def convert(self, model_dir: Path) -> Path:
        """`model_dir` (a Hugging Face folder) as f32 GGUF: f32, so that its greedy output can be
        compared token for token with this project's engine."""
        out = self.gguf(model_dir)
        if out.exists():
            return out
        self.fetch_sources()
        check_gpt2_pretokenizer(model_dir)
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = out.with_suffix(".partial")
        _run([sys.executable, "-c", _CONVERT, str(self.source), str(model_dir), "--outtype", "f32",
              "--outfile", str(partial)])
        partial.rename(out)
        return out


def check_gpt2_pretokenizer(model_dir: Path) -> None:
    """Refuse a tokenizer that is not byte-level BPE split as GPT-2 splits: the converter is told
    its pre-tokenizer is GPT-2's, which must then be true."""
    path = Path(model_dir) / "tokenizer.json"
    if not path.exists():
        raise ValueError(f"{model_dir} has no tokenizer.json: only byte-level BPE tokenizers are converted here")
    spec = json.loads(path.read_text())
    pre, model = spec.get("pre_tokenizer") or {}, spec.get("model") or {}
    if model.get("type") != "BPE" or pre.get("type") != "ByteLevel" or not pre.get("use_regex", True) \
            or pre.get("add_prefix_space") or spec.get("normalizer"):
        raise ValueError(f"{path}: the pre-tokenizer is not GPT-2's (byte-level BPE, its split pattern, no"
                         f" prefix space, no normalizer): {pre}; convert it with convert_hf_to_gguf.py itself")


def setup(models: dict[str, Path], root: Path | None = None) -> tuple[LlamaCpp, dict[str, Path]]:
    """llama-server built and each of `models` ({name: Hugging Face folder}) converted: the build
    and {name: GGUF file}."""
    llama = LlamaCpp(root or default_dir())
    llama.build_server()
    return llama, {name: llama.convert(path) for name, path in models.items()}


def _run(command: list[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stdout + done.stderr)[-3000:]
        raise RuntimeError(f"{Path(command[0]).name} {command[1]} ... failed (exit {done.returncode}):\n{tail}")
