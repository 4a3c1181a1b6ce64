"""``attnprof validate-window``: replay prompts with sinks + window vs full attention."""

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

__all__ = ["add_parser"]


def add_parser(sub: Any) -> None:
    from attnprof.tools.replay import TARGET_AGREEMENT

    p = sub.add_parser(
        "validate-window",
        help="replay prompts through the transformers model with sinks + window applied",
        description="Runs each prompt with full attention and with sinks + window as an "
                    "attention mask, and compares next-token distributions where the window "
                    "binds: greedy agreement and mean KL(full || windowed). The result is "
                    "'safe' only when both meet their targets.")
    p.add_argument("--window", type=int, required=True, help="window w (keys incl. itself)")
    p.add_argument("--sinks", type=int, required=True, help="sink tokens s")
    p.add_argument("--model", default="smollm2", help="checkpoint dir or 'smollm2'")
    p.add_argument("--prompts", type=Path, metavar="FILE",
                   help="one prompt per line, a JSON list of strings or JSONL {\"prompt\"} "
                        "(default: built-in demo-shaped documents)")
    p.add_argument("--layers", help="layers to window, e.g. '2-29' (default: all)")
    p.add_argument("--max-tokens", type=int, default=4096, help="truncate prompts (4096)")
    p.add_argument("--generate", type=int, default=0,
                   help="extend each prompt by N greedy tokens first (decode positions)")
    p.add_argument("--target-agreement", type=float, default=TARGET_AGREEMENT,
                   help=f"greedy agreement needed for 'safe' (default {TARGET_AGREEMENT})")
    p.add_argument("--max-kl", type=float, default=0.05,
                   help="mean KL (nats) allowed for 'safe' (default 0.05)")
    p.add_argument("--min-positions", type=int, default=64,
                   help="compared positions needed before 'safe' (default 64)")
    p.add_argument("--out", type=Path, help="also write the JSON result here")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_run)


def check_args(args: argparse.Namespace) -> None:
    """Every flag and the output file, before the model is loaded and the replay runs."""
    from attnprof.cli.suggest import parse_layers

    if args.window < 1 or args.sinks < 0:
        raise CliError("--window must be >= 1 and --sinks >= 0")
    int_in_range(args.window, "--window", 1, MAX_LENGTH)
    int_in_range(args.sinks, "--sinks", 0, MAX_LENGTH)
    if args.max_tokens < 2 or args.generate < 0:
        raise CliError("--max-tokens must be >= 2 and --generate >= 0")
    int_in_range(args.max_tokens, "--max-tokens", 2, MAX_LENGTH)
    int_in_range(args.generate, "--generate", 0, 1 << 20)
    int_in_range(args.min_positions, "--min-positions", 0, MAX_LENGTH)
    # NaN fails every comparison: written so that it is refused.
    if not 0 <= args.target_agreement <= 1 or not 0 <= args.max_kl < math.inf:
        raise CliError("--target-agreement must be in [0, 1] and --max-kl >= 0")
    parse_layers(args.layers, 100_000)  # syntax now; the model's bound once it is loaded
    if args.out is not None:
        check_out_file(args.out)


def _run(args: argparse.Namespace) -> int:
    from attnprof.cli.suggest import parse_layers
    from attnprof.tools.replay import (
        ReplayError,
        default_prompts,
        load_model,
        read_prompts,
        replay,
    )

    check_args(args)
    try:
        prompts = read_prompts(args.prompts) if args.prompts else None
        model, tok, _ = load_model(str(resolve_model(args.model)))
        layers = parse_layers(args.layers, model.config.get_text_config().num_hidden_layers)
        if prompts is None:
            prompts = default_prompts(tok)
        print(f"attnprof: replaying {len(prompts)} prompts (full vs {args.sinks} sinks + "
              f"{args.window} window)", file=sys.stderr)
        res = replay(model, tok, prompts, args.window, args.sinks, layers=layers,
                     max_tokens=args.max_tokens, generate=args.generate,
                     target_agreement=args.target_agreement, max_kl=args.max_kl,
                     min_positions=args.min_positions)
    except ReplayError as err:
        raise CliError(str(err)) from None
    if args.out is not None:
        write_json(args.out, res)
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        print(f"replay of {res['prompts']} prompts, {res['positions']} positions where the "
              f"window binds: greedy agreement {res['agreement']:.1%}, mean KL "
              f"{res['mean_kl']:.4g} nats")
        print(res["verdict"] + f" (target agreement >= {res['target_agreement']:.0%}, "
              f"mean KL <= {res['max_kl']:g})")
    return 0
