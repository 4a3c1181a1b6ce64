"""``attnprof validate-heads``: replay the model with underused heads' outputs replaced."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from attnprof.cli._common import (
    MAX_LENGTH,
    CliError,
    check_out_file,
    int_in_range,
    resolve_model,
    write_json,
)

__all__ = ["add_parser", "render"]


def add_parser(sub: Any) -> None:
    from attnprof.tools.validate_heads import MAX_KL, MIN_POSITIONS, TARGET_AGREEMENT

    p = sub.add_parser(
        "validate-heads",
        help="replay the model with dormant/near-uniform heads' outputs replaced by their "
             "mean and redundant heads' by their twin's",
        description="Finds underused heads (dormant, near-uniform, redundant) from head "
                    "statistics collected on --prompts (or read from --head-stats), or takes "
                    "them from --heads, then replays the prompts with each head's output "
                    "replaced and compares teacher-forced next-token distributions with the "
                    "unedited model: greedy agreement and mean KL(base || edited). A head is "
                    "'safe' only when both meet their targets.")
    p.add_argument("--model", default="smollm2", help="checkpoint dir or 'smollm2'")
    p.add_argument("--prompts", type=Path, metavar="FILE",
                   help="one prompt per line, a JSON list of strings or JSONL {\"prompt\"} "
                        "(default: built-in demo-shaped documents)")
    p.add_argument("--heads", metavar="SPEC",
                   help="heads to replay instead of the findings: LAYER.HEAD (mean output) "
                        "or LAYER.HEAD~TWIN (the twin head's output), comma-separated, e.g. "
                        "'3.2,5.1~0'")
    p.add_argument("--head-stats", type=Path, metavar="FILE",
                   help="find the heads in these statistics (a snapshot with head_stats, or "
                        "HeadStatsAccumulator JSON) instead of collecting them on --prompts")
    p.add_argument("--max-heads", type=int, default=16,
                   help="replay at most this many findings (default 16; each costs one "
                        "forward per prompt)")
    p.add_argument("--max-tokens", type=int, default=512, help="truncate prompts (512)")
    p.add_argument("--target-agreement", type=float, default=TARGET_AGREEMENT,
                   help=f"greedy agreement needed for 'safe' (default {TARGET_AGREEMENT})")
    p.add_argument("--max-kl", type=float, default=MAX_KL,
                   help=f"mean KL (nats) allowed for 'safe' (default {MAX_KL})")
    p.add_argument("--min-positions", type=int, default=MIN_POSITIONS,
                   help=f"compared positions needed before 'safe' (default {MIN_POSITIONS})")
    p.add_argument("--out", type=Path, help="also write the JSON result here")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_run)


def _check_args(args: argparse.Namespace) -> None:
    from attnprof.tools.replay import ReplayError
    from attnprof.tools.validate_heads import parse_heads

    if args.heads is not None and args.head_stats is not None:
        raise CliError("--heads and --head-stats are alternatives: give one")
    int_in_range(args.max_tokens, "--max-tokens", 2, MAX_LENGTH)
    int_in_range(args.max_heads, "--max-heads", 1, 100_000)
    int_in_range(args.min_positions, "--min-positions", 0, MAX_LENGTH)
    ok = (math.isfinite(args.target_agreement) and 0 <= args.target_agreement <= 1
          and math.isfinite(args.max_kl) and args.max_kl >= 0)
    if not ok:
        raise CliError("--target-agreement must be in [0, 1] and --max-kl >= 0")
    if args.heads is not None:
        try:
            parse_heads(args.heads, 1 << 20, 1 << 20)  # syntax now, bounds once loaded
        except ReplayError as err:
            raise CliError(str(err)) from None
    if args.out is not None:
        check_out_file(args.out)


def _run(args: argparse.Namespace) -> int:
    from attnprof.analyze.sparsity.savings import LengthDistribution
    from attnprof.cli.suggest import load_arch, load_head_stats
    from attnprof.tools.replay import (
        ReplayError,
        collect_head_stats,
        default_prompts,
        load_model,
        read_prompts,
    )
    from attnprof.tools.validate_heads import edits_from_findings, parse_heads, replay_heads

    _check_args(args)
    path = resolve_model(args.model)
    arch = load_arch(str(path))
    stats = load_head_stats(args.head_stats) if args.head_stats is not None else None
    if stats is not None and (stats.num_layers, stats.num_q_heads) != (arch.num_layers,
                                                                        arch.num_heads):
        raise CliError(f"head statistics are for {stats.num_layers} layers x "
                       f"{stats.num_q_heads} heads, the model has {arch.num_layers} x "
                       f"{arch.num_heads}")
    edits = None
    if args.heads is not None:  # bounds from config.json, before the weights load
        try:
            edits = parse_heads(args.heads, arch.num_layers, arch.num_heads)
        except ReplayError as err:
            raise CliError(str(err)) from None
    found: dict[str, Any] | None = None
    if edits is None and stats is not None:  # before the weights load: fail fast
        # the statistics' own traffic is not the prompts': KV shares without lengths
        found = _findings(stats, arch, None, args.max_heads)
        edits = edits_from_findings(found["findings"][:args.max_heads])
    try:
        texts = read_prompts(args.prompts) if args.prompts else None
        model, tok, _ = load_model(str(path))
        if texts is None:
            texts = default_prompts(tok, lengths=(200, 400))
        ids = [tok(t, return_tensors="pt")["input_ids"][:, :args.max_tokens] for t in texts]
        ids = [x for x in ids if x.shape[1] >= 2]
        if not ids:
            raise CliError("no prompt has 2 tokens or more")
        if edits is None:
            print(f"attnprof: collecting head statistics on {len(ids)} prompts",
                  file=sys.stderr)
            stats = collect_head_stats(model, tok, ids)
            dist = LengthDistribution.from_lengths([x.shape[1] for x in ids], "prompts")
            found = _findings(stats, arch, dist, args.max_heads)
            edits = edits_from_findings(found["findings"][:args.max_heads])
        print(f"attnprof: replaying {len(ids)} prompts with {len(edits)} heads replaced, one "
              "at a time", file=sys.stderr)
        res = replay_heads(model, ids, edits, target_agreement=args.target_agreement,
                           max_kl=args.max_kl, min_positions=args.min_positions)
    except ReplayError as err:
        raise CliError(str(err)) from None
    if found is not None:
        by = {(f["layer"], f["head"]): f for f in found["findings"]}
        for r in res["results"]:
            f = by.get((r["layer"], r["head"]), {})
            r["kv_share"] = f.get("kv_share")
            r["evidence"] = f.get("evidence")
    out = {"model": "smollm2" if args.model == "smollm2" else path.name,
           "underused": found, "replay": res}
    if args.out is not None:
        write_json(args.out, out)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(render(out), end="")
    return 0


def _findings(stats: Any, arch: Any, dist: Any, limit: int) -> dict[str, Any]:
    """Underused heads, or :class:`CliError` when there is nothing to validate."""
    from attnprof.analyze.sparsity.underused import UnderusedThresholds, find_underused

    th = UnderusedThresholds()
    try:  # statistics collected with another sinks grid cannot be read at these thresholds
        th.validate(stats)
    except ValueError as err:
        raise CliError(f"--head-stats: {err}") from None
    found = find_underused(stats, th, shape=arch, dist=dist)
    if not found["findings"]:
        raise CliError(f"nothing to validate: no underused heads found in "
                       f"{found['heads_checked']} query heads with statistics (give --heads "
                       "to replay chosen ones)")
    return found


def render(out: dict[str, Any]) -> str:
    """The terminal table: one row per replayed head, then the safe ones together."""
    res = out["replay"]
    lines = []
    found = out.get("underused")
    if found is not None:
        c = found["counts"]
        lines.append(f"underused heads in {found['heads_checked']} query heads: "
                     f"{c['dormant']} dormant, {c['near_uniform']} near-uniform, "
                     f"{c['redundant']} redundant (KV share: {found['kv_share_basis']})")
    lines.append(f"replay: {res['prompts']} prompts, {res['positions']} positions, "
                 f"{res['comparison']}")
    lines.append(f"{'kind':<13}{'head':>8}{'twin':>6}{'KV share':>10}{'agreement':>11}"
                 f"{'mean KL':>10}{'max KL':>9}  verdict")
    for r in res["results"]:
        share = r.get("kv_share")
        lines.append(f"{r['kind']:<13}{r['layer']:>5}.{r['head']:<2}"
                     f"{'-' if r['twin'] is None else r['twin']:>6}"
                     f"{'-' if share is None else f'{share:.2%}':>10}"
                     f"{r['agreement']:>10.2%} {r['mean_kl']:>9.4g} {r['max_kl']:>8.3g}  "
                     f"{'safe' if r['safe'] else 'NOT safe'}")
    both = res.get("combined")
    if both:
        lines.append(f"all {len(both['heads'])} safe heads together: agreement "
                     f"{both['agreement']:.2%}, mean KL {both['mean_kl']:.4g} -> "
                     f"{both['verdict']}")
    lines.append(f"targets: agreement >= {res['target_agreement']:.0%}, mean KL <= "
                 f"{res['max_kl_target']:g} nats, >= {res['min_positions']} positions")
    return "\n".join(lines) + "\n"
