"""The `tiers` command. Subcommands: `config` (print the resolved config), `convert` (a checkpoint to one
consolidated fp32 state dict), `launch` (a job over one or many nodes), `estimate` (per-rank memory of every
strategy), `tune` (short trials of the strategies that fit; the fastest one's config)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from engine.config import ConfigError, load_config
from engine.config_sections import parse_byte_size


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


def _launch_options(args: argparse.Namespace):
    """LaunchOptions from the arguments: `colossalai run`'s formats under --as-colossalai, else DeepSpeed's."""
    import dataclasses

    from engine.launcher import LauncherKind, LaunchError, LaunchOptions
    from engine.launcher.colossalai_args import ColossalAIRun, colossalai_options

    if args.as_colossalai:
        run = ColossalAIRun(args.script, tuple(args.script_args), args.host, args.hostfile, args.include,
                            args.exclude, args.num_nodes, args.nproc_per_node, args.master_addr, args.master_port,
                            args.extra_launch_args, args.ssh_port, args.module)
        return dataclasses.replace(colossalai_options(run), max_restarts=args.max_restarts,
                                   launcher=LauncherKind(args.launcher) if args.launcher else None,
                                   bind_cores=args.bind_cores, bind_core_list=args.bind_core_list,
                                   as_deepspeed=args.as_deepspeed, local_rank_arg=not args.no_local_rank)
    for flag, value in (("--host", args.host), ("--extra_launch_args", args.extra_launch_args)):
        if value is not None:
            raise LaunchError(f"{flag} is `colossalai run`'s; add --as-colossalai (or use --hostfile / --include)")
    return LaunchOptions(script=args.script, script_args=tuple(args.script_args),
                         hostfile=args.hostfile, include=args.include, exclude=args.exclude,
                         num_nodes=args.num_nodes, nproc_per_node=args.nproc_per_node, master_addr=args.master_addr,
                         master_port=args.master_port, launcher=LauncherKind(args.launcher) if args.launcher else None,
                         max_restarts=args.max_restarts, as_deepspeed=args.as_deepspeed,
                         local_rank_arg=not args.no_local_rank, bind_cores=args.bind_cores,
                         bind_core_list=args.bind_core_list, module=args.module,
                         ssh_port=args.ssh_port)


def _launch_command(args: argparse.Namespace) -> int:
    from engine.launcher import LaunchError, launch

    try:
        return launch(_launch_options(args), dry_run=args.dry_run)
    except LaunchError as e:
        print(f"tiers launch: {e}", file=sys.stderr)
        return 2


def _byte_budgets(args: argparse.Namespace):
    from engine.estimate import RankBudgets

    return RankBudgets(*(parse_byte_size(value, flag) for value, flag in
                         ((args.device_memory, "--device-memory"), (args.cpu_memory, "--cpu-memory"),
                          (args.nvme_space, "--nvme-space"))))


def _read_json(path: str | None) -> dict | None:
    if path is None:
        return None
    with open(path) as f:
        return json.load(f)


def _estimate_command(args: argparse.Namespace) -> int:
    from engine.estimate import EstimateSettings, estimate, format_estimate, model_factory
    from engine.estimate.estimator import default_strategies

    try:  # ModelSpecError and json's errors are ValueErrors
        config = _read_json(args.config)
        settings = EstimateSettings(_byte_budgets(args), args.seq_len,
                                    None if args.device == "auto" else args.device == "cpu", args.zero_init)
        est = estimate(model_factory(args.model), config, args.world,
                       default_strategies(config, args.world, [args.tp], nvme=True), settings)
    except (OSError, ValueError, RuntimeError) as e:
        print(f"tiers estimate: {e}", file=sys.stderr)
        return 2
    print(format_estimate(est))
    return 0


def _tune_command(args: argparse.Namespace) -> int:
    from engine.estimate import model_factory
    from engine.estimate.tune import TuneSettings, format_tune, tune, write_config

    try:  # ModelSpecError and json's errors are ValueErrors
        if args.nvme and not os.path.isdir(args.nvme):
            raise ValueError(f"--nvme {args.nvme}: no such directory")
        result = tune(model_factory(args.model), args.world, _byte_budgets(args), _read_json(args.config),
                      TuneSettings(args.nvme, args.time_budget, args.steps, seq_len=args.seq_len, tp_sizes=(args.tp,)))
    except (OSError, ValueError, RuntimeError) as e:
        print(f"tiers tune: {e}", file=sys.stderr)
        return 2
    print(format_tune(result))
    if result.chosen is None:
        return 1
    write_config(result, args.out)
    print(f"Wrote {args.out}")
    return 0


def add_model_and_budget_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help="package.module:factory (e.g. engine.models:gpt_small), or a Hugging Face config.json")
    parser.add_argument("--world", type=int, default=int(os.environ.get("WORLD_SIZE", "1")),
                        help="ranks in the job (default: $WORLD_SIZE or 1)")
    parser.add_argument("--device-memory", default=None, help="bytes one rank may use on its device, e.g. 80GB")
    parser.add_argument("--cpu-memory", default=None, help="host memory one rank may use, e.g. 32GiB")
    parser.add_argument("--seq-len", type=int, default=None,
                        help="tokens per sample (default: the model's context length, at most 2048)")


def add_launch_arguments(launch: argparse.ArgumentParser) -> None:
    from engine.launcher import LauncherKind
    from engine.launcher.plan import DEFAULT_MASTER_PORT

    launch.add_argument("--hostfile", default=None,
                        help="DeepSpeed-style hostfile, one 'hostname slots=N' line per host (default: this machine)")
    launch.add_argument("--include", default=None, help="hosts/slots to use, e.g. worker-1:0,1@worker-2")
    launch.add_argument("--exclude", default=None, help="hosts/slots to leave out, same form as --include")
    launch.add_argument("--num_nodes", "--num-nodes", type=int, default=None, help="use the first N hosts")
    launch.add_argument("--nproc_per_node", "--nproc-per-node", "--num_gpus", type=int, default=None,
                        help="processes per node (default: every slot; without a hostfile, every GPU or 1)")
    launch.add_argument("--master_addr", "--master-addr", default=None,
                        help="rendezvous host (default: the first node; 127.0.0.1 with --launcher local)")
    launch.add_argument("--master_port", "--master-port", type=int, default=DEFAULT_MASTER_PORT,
                        help=f"rendezvous port (default {DEFAULT_MASTER_PORT})")
    launch.add_argument("--launcher", choices=[k.value for k in LauncherKind], default=None,
                        help="how nodes are started: ssh, pdsh, slurm (srun), or local (every node on this machine); "
                             "default: ssh with a hostfile, else local")
    launch.add_argument("--max_restarts", "--max-restarts", type=int, default=0,
                        help="torchrun restarts of the whole job after a worker fails (uses a c10d rendezvous)")
    launch.add_argument("--as-deepspeed", "--as_deepspeed", action="store_true",
                        help="run a DeepSpeed script unchanged: its `import deepspeed` is engine.compat.deepspeed, "
                             "and it gets --local_rank=N as from DeepSpeed's launcher (docs/launcher.md)")
    launch.add_argument("--no_local_rank", "--no-local-rank", action="store_true",
                        help="with --as-deepspeed: pass no --local_rank argument (DeepSpeed's --no_local_rank)")
    launch.add_argument("--bind-cores", "--bind_cores_to_rank", action="store_true",
                        help="pin each local rank to its share of the node's physical cores and set its thread count "
                             "to match (DeepSpeed's --bind_cores_to_rank; docs/launcher.md)")
    launch.add_argument("--bind_core_list", "--bind-core-list", default=None,
                        help="with --bind-cores: the CPUs to share out, e.g. 0-7,16-23 (default: all this process "
                             "may use)")
    launch.add_argument("--as-colossalai", "--as_colossalai", action="store_true",
                        help="run a ColossalAI script unchanged (its `import colossalai` is engine.compat.colossalai), "
                             "taking `colossalai run`'s arguments in its formats: --host / --include / --exclude "
                             "comma lists, a hostfile of one host per line (docs/launcher.md)")
    launch.add_argument("-H", "--host", default=None, help="with --as-colossalai: hosts, comma-separated")
    launch.add_argument("--extra_launch_args", "--extra-launch-args", default=None,
                        help="with --as-colossalai: torchrun flags as a=1,b (--a=1 --b)")
    launch.add_argument("--ssh-port", "--ssh_port", type=int, default=None, help="the port ssh reaches the hosts on")
    launch.add_argument("-m", dest="module", action="store_true",
                        help="the script is a module (package.module), run as `python -m` runs it")
    launch.add_argument("--dry-run", "--dry_run", action="store_true", help="print every node's command and exit")
    launch.add_argument("script", help="the training script each process runs (with -m: the module)")
    launch.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments, passed as they are")


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
                         help="split the output into files of at most this size, "
                              "e.g. 5GB or 500MiB (default: one file)")
    convert.set_defaults(run=_convert_command)
    # allow_abbrev off: the script's own options (`--dry`, `--a`) are never read as abbreviations of the launcher's
    launch = sub.add_parser("launch", allow_abbrev=False, help="run a script on one or many nodes: torchrun on "
                            "each, started by ssh, pdsh, srun or locally")
    add_launch_arguments(launch)
    launch.set_defaults(run=_launch_command)
    est = sub.add_parser("estimate", help="per-rank device, CPU and NVMe bytes of every ZeRO stage / offload / "
                         "tensor-parallel strategy, and what fits the budgets")
    add_model_and_budget_arguments(est)
    est.add_argument("--config", required=True, help="JSON config (batch size, precision, optimizer, chunks)")
    est.add_argument("--tp", type=int, default=1, help="also estimate this tensor-parallel size (1 and the config's "
                     "always)")
    est.add_argument("--nvme-space", default=None, help="disk bytes one rank's swap files may take at their peak")
    est.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                     help="the compute device (cpu: the device tier is host memory; default: cuda if present)")
    est.add_argument("--zero-init", action="store_true",
                     help="the model is built under engine.zero_init (no rank builds it whole)")
    est.set_defaults(run=_estimate_command)
    tune = sub.add_parser("tune", help="short trials of the strategies the estimate says fit, on this machine; "
                          "writes the fastest that fits as a config")
    add_model_and_budget_arguments(tune)
    tune.add_argument("--config", default=None,
                      help="the config to start from (batch size, precision, optimizer); default: micro batch 1, AdamW")
    tune.add_argument("--tp", type=int, default=1, help="also try this tensor-parallel size")
    tune.add_argument("--nvme", default=None, help="a directory on NVMe: also try offloading there")
    tune.add_argument("--time-budget", type=float, default=None,
                      help="seconds of trials; a trial starts only if one more as long as the longest fits")
    tune.add_argument("--steps", type=int, default=3, help="timed optimizer steps per trial (after one warm-up)")
    tune.add_argument("--out", default="tiers_tuned.json", help="where the chosen config goes")
    tune.set_defaults(run=_tune_command, nvme_space=None)
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
