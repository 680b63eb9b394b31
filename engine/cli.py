"""The `tiers` command. Subcommands so far: `config` (print the resolved config)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from engine.config import ConfigError, load_config


def _config_command(args: argparse.Namespace) -> int:
    cfg = load_config(args.file)
    resolved = cfg.to_dict()
    batch = cfg.batch_sizes(args.dp)
    resolved.update(train_batch_size=batch.train_batch_size, train_micro_batch_size_per_gpu=batch.micro_batch_size,
                    gradient_accumulation_steps=batch.gradient_accumulation_steps)
    print(json.dumps(resolved, indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tiers", description="Tiers training engine tools.")
    sub = parser.add_subparsers(dest="command", required=True)
    config = sub.add_parser("config", help="validate a config file and print it with every default and derived value")
    config.add_argument("file", help="JSON config file")
    config.add_argument("--dp", type=int, default=int(os.environ.get("WORLD_SIZE", "1")),
                        help="data-parallel world size used to derive batch sizes (default: $WORLD_SIZE or 1)")
    config.set_defaults(run=_config_command)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except ConfigError as e:
        print(f"tiers {args.command}: config error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
