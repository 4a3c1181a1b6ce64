"""``attnprof compat``: which attention backends activate for a head dim, dtype and GPU."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from importlib import resources
from pathlib import Path
from typing import Any

from attnprof.cli._common import CliError, check_out_file, ensure_writable_dir, write_atomic

__all__ = ["add_parser"]


def add_parser(sub: Any) -> None:
    p = sub.add_parser("compat", help="which attention backends activate for a case, and why "
                                      "the others do not (versioned rules, no GPU needed)")
    p.add_argument("--head-dim", type=int, default=128, help="attention head dim (default 128)")
    p.add_argument("--dtype", default="bf16", help="fp32, fp16, bf16 or fp8 (default bf16)")
    p.add_argument("--gpu", default="h100", help="hardware: sm80..sm100, a100, h100, b200, "
                                                  "mi300x, cpu, avx512... (default h100)")
    p.add_argument("--sliding-window", action="store_true", help="the model uses local attention")
    p.add_argument("--sinks", action="store_true", help="learned attention-sink logits")
    p.add_argument("--fp8-kv", action="store_true", help="fp8 KV cache")
    p.add_argument("--mask", action="store_true", help="an explicit attention mask (padding)")
    p.add_argument("--json", action="store_true", help="print the verdicts as JSON")
    p.add_argument("--markdown", action="store_true",
                   help="print the whole matrix as Markdown (docs/compat-matrix.md)")
    p.add_argument("--regenerate", action="store_true",
                   help="re-derive vLLM's CUDA backend verdicts from the installed vLLM's own "
                        "code and write analyze/data/vllm_matrix.json (or --out)")
    p.add_argument("--out", type=Path, default=None, help="write the output to this file")
    p.set_defaults(func=_run)


_MAX_HEAD_DIM = 4096


def _regenerate(out: Path | None) -> int:
    from attnprof.analyze import vllm_matrix
    from attnprof.tools import vllm_matrix as derive

    target = out or Path(str(resources.files("attnprof.analyze").joinpath(
        "data/vllm_matrix.json")))
    try:  # (_run already refused a directory --out)
        ensure_writable_dir(target.parent)  # before the work, not after it
    except CliError as err:
        raise CliError(f"cannot write {target} ({err}); pass --out FILE") from None
    try:
        doc = derive.regenerate(progress=lambda m: print(m, file=sys.stderr))
    except derive.DeriveError as err:
        raise CliError(str(err)) from None
    old = None
    if out is None:
        try:
            old = vllm_matrix.load()
        except (OSError, ValueError):  # a damaged shipped file: this run replaces it
            old = None
    write_atomic(target, derive.dump(doc))
    n = sum(len(c["cases"]) for c in doc["capabilities"].values())
    print(f"wrote {target}: {n} cases from {doc['vllm_distribution']} {doc['vllm_version']} "
          f"(sources sha256:{doc['source_digest']['combined'][:12]})")
    if old is not None:
        changed = _changed(old, doc)
        print(f"{len(changed)} of {n} cases differ from the data shipped before"
              + (":" if changed else ""))
        for line in changed[:20]:
            print(f"  {line}")
        if changed:
            print("regenerate the docs: attnprof compat --markdown --out docs/compat-matrix.md")
    return 0


def _changed(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """One line per case whose verdicts differ, naming the fields that changed."""
    from attnprof.analyze import vllm_matrix

    def rows(d: dict[str, Any]) -> dict[tuple[Any, ...], Any]:
        return {(c.hardware, c.head_size, c.dtype, c.features): c for c in vllm_matrix.cases(d)}

    fields = ("selected", "flash_attn_version", "flash_attn_note")
    a, b = rows(old), rows(new)
    out = []
    for k in sorted(set(a) | set(b), key=str):
        was, now = a.get(k), b.get(k)
        where = f"{k[0]} head {k[1]} {k[2]} [{k[3] or 'none'}]"
        if was is None or now is None:
            out.append(f"{where}: {'new case' if was is None else 'case gone'}")
            continue
        diffs = [f"{f} {getattr(was, f)!r} -> {getattr(now, f)!r}" for f in fields
                 if getattr(was, f) != getattr(now, f)]
        moved = sorted(n for n in set(was.invalid) | set(now.invalid)
                       if was.invalid.get(n) != now.invalid.get(n))
        if moved:  # the reasons themselves are long: name whose changed
            diffs.append(f"vLLM's reasons for {', '.join(moved)}")
        if diffs:
            out.append(f"{where}: " + "; ".join(diffs))
    return out


def _derive_off_grid(hw: str, head_dim: int, dtype: str,
                     feats: dict[str, bool]) -> Any:
    """vLLM's verdicts for a case the shipped grid lacks, derived now from the installed
    vLLM (a child process); None where the shipped data answers or nothing can."""
    from attnprof.analyze import rules, vllm_matrix

    spec = rules.load_matrix()["hardware"][hw]
    grid = vllm_matrix.load()["grid"]
    if (spec["vendor"] != "nvidia" or dtype not in grid["dtypes"]
            or vllm_matrix.lookup(hw, head_dim, dtype, feats) is not None
            or importlib.util.find_spec("vllm") is None):
        return None
    from attnprof.tools import vllm_matrix as derive

    case = {"head_size": head_dim, "dtype": dtype,
            "features": [f for f in vllm_matrix.FEATURES if feats.get(f)]}
    cap = (int(spec["cc"][0]), int(spec["cc"][1]))
    print(f"head dim {head_dim} is outside the shipped grid: deriving it from the installed "
          "vLLM's own code...", file=sys.stderr)
    try:
        got = derive.derive(cap, [case])
    except derive.DeriveError as err:
        raise CliError(str(err)) from None
    return vllm_matrix.from_derived(hw, cap, got, got["cases"][0])


def _run(args: argparse.Namespace) -> int:
    from attnprof.analyze import compat, rules

    if args.out is not None and args.out.is_dir():
        raise CliError(f"--out {args.out} is a directory")
    if args.out is not None:
        check_out_file(args.out)
    if args.regenerate:
        return _regenerate(args.out)
    try:
        from attnprof.analyze import vllm_matrix

        vllm_matrix.load()
    except (OSError, ValueError) as err:
        raise CliError(f"the shipped vLLM matrix is unreadable ({err}); reinstall attnprof "
                       "or run attnprof compat --regenerate") from None
    if args.markdown:
        text = compat.markdown_matrix()
    else:
        if not 0 < args.head_dim <= _MAX_HEAD_DIM:
            raise CliError(f"--head-dim must be an integer in 1..{_MAX_HEAD_DIM}, "
                           f"got {args.head_dim}")
        try:
            hw = rules.resolve_hardware(args.gpu)
        except ValueError as err:
            raise CliError(str(err)) from None
        try:
            dtype = rules.normalize_dtype(args.dtype)
        except ValueError as err:
            raise CliError(str(err)) from None
        feats = {"mask": args.mask, "sliding_window": args.sliding_window,
                 "sinks": args.sinks, "fp8_kv": args.fp8_kv}
        rep = compat.case_report(args.gpu, args.head_dim, dtype, feats,
                                 vllm_case=_derive_off_grid(hw, args.head_dim, dtype, feats))
        text = json.dumps(rep, indent=2) if args.json else compat.render_case(rep)
    if args.out is not None:
        write_atomic(args.out, text + "\n")
    else:
        print(text)
    return 0
