"""The `tiers` command. Subcommands so far: `config` (print the resolved config), `convert` (a checkpoint to one
consolidated fp32 state dict)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from engine.config import ConfigError, load_config, parse_byte_size


def _config_command(args: argparse.Namespace) -> int:
    cfg = load_config(args.file)
    resolved = cfg.to_dict()
    batch = cfg.batch_sizes(args.dp)
    resolved.update(train_batch_size=batch.train_batch_size, train_micro_batch_size_per_gpu=batch.micro_batch_size,
                    gradient_accumulation_steps=batch.gradient_accumulation_steps)
    print(json.dumps(resolved, indent=2))
    return 0


def _convert_command(args: argparse.Namespace) -> int:
    from engine.checkpoint import CheckpointError, consolidate, resolve

    try:
        max_bytes = parse_byte_size(args.max_shard_size, "--max-shard-size") if args.max_shard_size else None
        source = resolve(args.checkpoint, args.tag)
        names = consolidate(source, args.out, max_bytes)
    except (CheckpointError, ConfigError) as e:
        print(f"tiers convert: {e}", file=sys.stderr)
        return 1
    print(f"tiers convert: {source} -> {args.out}: {', '.join(names)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tiers", description="Tiers training engine tools.")
    sub = parser.add_subparsers(dest="command", required=True)
    config = sub.add_parser("config", help="validate a config file and print it with every default and derived value")
    config.add_argument("file", help="JSON config file")
    config.add_argument("--dp", type=int, default=int(os.environ.get("WORLD_SIZE", "1")),
                        help="data-parallel world size used to derive batch sizes (default: $WORLD_SIZE or 1)")
    config.set_defaults(run=_config_command)
    convert = sub.add_parser("convert", help="write a checkpoint's model as one fp32 state dict (safetensors), "
                             "streaming one parameter at a time")
    convert.add_argument("checkpoint", help="a checkpoint directory, or the save directory holding `latest`")
    convert.add_argument("out", help="output directory (model.safetensors, or shards and model.safetensors.index.json)")
    convert.add_argument("--tag", default=None, help="the checkpoint to convert (default: the one `latest` names)")
    convert.add_argument("--max-shard-size", default=None,
                         help="split the output into files of at most this size, e.g. 5GB or 500MiB (default: one file)")
    convert.set_defaults(run=_convert_command)
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
