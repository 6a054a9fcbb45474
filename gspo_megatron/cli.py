"""The ``gspo-megatron`` command line: train, plan, score.

    gspo-megatron train examples/tiny_moe_cpu.yaml [section.field=value ...] [--resume]
    torchrun --nproc-per-node 8 --nnodes 2 ... $(which gspo-megatron) train examples/qwen3_30b_a3b.yaml
    torchrun --max-restarts 3 ... train CONFIG.yaml      # a dead rank: workers restarted, resumed, servers kept
    gspo-megatron plan examples/qwen3_30b_a3b.yaml --nodes 2 --gpus-per-node 8
    gspo-megatron score --model DIR --input records.jsonl [--tp N --pp N --ep N]
"""

from __future__ import annotations

import argparse
import os
import sys


def _train(args) -> int:
    from gspo_megatron.train.startup.bootstrap import model_hf_config, resolve_hub_model
    from gspo_megatron.train.startup.config import load_config
    from gspo_megatron.train.startup.validate import validate, validate_machine, validate_megatron

    cfg = load_config(args.config, args.overrides)
    resolve_hub_model(cfg)  # model.hf_dir=Qwen/Qwen3-30B-A3B: its snapshot in huggingface_hub's cache
    # The layout against the model's config too, before any process group starts.
    hf = model_hf_config(cfg)
    validate(cfg, int(os.environ.get("WORLD_SIZE", "1")), hf)
    validate_megatron(hf)
    validate_machine(cfg)
    # Output dirs: writable, and never a used one without --resume (before anything is built or written).
    from gspo_megatron.train.resilience import elastic
    from gspo_megatron.train.startup.run_dirs import check_run_dirs

    rank = int(os.environ.get("RANK", "0"))
    note = check_run_dirs(cfg, args.resume, args.overwrite, rank, restarted=elastic.restarted())
    if note and rank == 0:
        print(note, flush=True)
    from gspo_megatron.train.startup.bootstrap import preflight
    from gspo_megatron.train.startup.data import DataError

    try:
        preflight(cfg, rank)  # prompt files, rewards, the model's tensors, attached servers: before the model is built
    except DataError as error:
        print(f"gspo-megatron train: DataError: {error}", file=sys.stderr)
        return 1
    from gspo_megatron.train.resilience import preemption
    from gspo_megatron.train.startup.data import DataError
    from gspo_megatron.rollout.errors import RewardError, RolloutError, StartInterrupted
    from gspo_megatron.train.resilience.faults import NonFiniteError
    from gspo_megatron.train.loop import train
    from gspo_megatron.train.records.progress import number

    # SIGTERM / SIGUSR1 (a scheduler's stop) and Ctrl-C: every rank finishes the step, saves it and exits 0
    # (train.resilience.preemption); a second one unwinds at once, so the loop's `finally` still stops the servers.
    preemption.install()
    try:
        metrics = train(cfg, resume=args.resume)
    except StartInterrupted as error:  # before the first step: nothing trained, nothing to save
        print(f"gspo-megatron train: stopped before the first step: {error}", file=sys.stderr)
        return 128 + error.signum
    except (DataError, NonFiniteError, RewardError, RolloutError) as error:  # a prompt file's line, the run's last
        # steps, the failing reward's sample, the rollout server concerned: named in the message
        print(f"gspo-megatron train: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    if int(os.environ.get("RANK", "0")) == 0:
        if "preempted_at_step" in metrics:
            signum = preemption.requested()
            print(f"gspo-megatron train: stopped by {preemption.describe(signum) if signum else 'a signal'} after "
                  f"step {metrics['preempted_at_step']} of "
                  f"{cfg.train.steps}, checkpoint saved in {cfg.checkpoint.dir or '(no checkpoint.dir)'}; "
                  "continue with --resume")
        else:
            print(f"gspo-megatron train: finished {cfg.train.steps} steps; metrics in {cfg.logging.dir}/metrics.jsonl, "
                  f"plots in {cfg.logging.dir}/metrics.png; last reward {number(metrics.get('reward_mean', float('nan')))}")
    return 0


def _plan(args) -> int:
    from gspo_megatron.train.startup.bootstrap import resolve_hub_model
    from gspo_megatron.train.startup.config import ConfigError, load_config
    from gspo_megatron.plan.layouts import fit_options, fits, format_plan

    if args.nodes is not None and args.nodes < 1:
        raise ConfigError(f"--nodes {args.nodes}: the number of nodes must be at least 1")
    if args.gpus_per_node < 0:
        raise ConfigError(f"--gpus-per-node {args.gpus_per_node}: must be at least 1 (or left out)")
    if args.nodes is not None and not args.gpus_per_node:
        raise ConfigError(f"--nodes {args.nodes} needs --gpus-per-node (the world is nodes x GPUs per node)")
    if args.gpu_memory_gib <= 0:
        raise ConfigError(f"--gpu-memory-gib {args.gpu_memory_gib:g} must be a positive number of GiB")
    if args.host_memory_gib <= 0:
        raise ConfigError(f"--host-memory-gib {args.host_memory_gib:g} must be a positive number of GiB")
    cfg = load_config(args.config, args.overrides)
    resolve_hub_model(cfg, ["config.json"])  # a Hub repo id: its config is all a plan reads
    world = (args.nodes or 1) * args.gpus_per_node if args.gpus_per_node else int(os.environ.get("WORLD_SIZE", "1"))
    node = {"gpus_per_node": args.gpus_per_node, "host_memory_gib": args.host_memory_gib}
    print(format_plan(cfg, world, args.gpu_memory_gib, impl=args.layer_spec, **node))
    if fits(cfg, world, args.gpu_memory_gib, impl=args.layer_spec, **node):
        return 0
    options = fit_options(cfg, world, args.gpu_memory_gib, impl=args.layer_spec, **node)
    where = f"{args.gpu_memory_gib:g} GiB per GPU" + (
        f" and {args.host_memory_gib:g} GiB of host memory per node" if cfg.optimizer.offload_fraction else "")
    print(f"gspo-megatron plan: this layout does not fit in {where}; "
          + (f"each of these would make it fit: {'; '.join(options)}" if options else
             "no single change of recompute, parallel sizes, micro batch, response length, optimizer offload or node "
             "count makes it fit: combine them, or use GPUs with more memory"), file=sys.stderr)
    return 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gspo-megatron",
        description="GSPO reinforcement learning for Mixture-of-Experts models on Megatron-Core, "
        "with rollouts from SGLang.",
        epilog="Run `gspo-megatron COMMAND --help` for each command's options.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser(
        "train", help="run GSPO/GRPO training from a YAML config",
        description="Run the RL loop: rollout from SGLang -> rewards -> log-probs -> advantages -> minibatch "
        "updates -> weight sync -> eval -> checkpoint. One process on CPU, or under torchrun with the parallel "
        "layout of the config. Every incompatibility is checked before any process group starts.",
    )
    train.add_argument("config", help="YAML config, e.g. examples/tiny_moe_cpu.yaml (sections: model, parallel, "
                       "rollout, algo, optimizer, data, train, checkpoint, logging, distributed)")
    train.add_argument("overrides", nargs="*", help="section.field=value overrides, e.g. parallel.tensor=2 algo.name=grpo")
    train.add_argument("--resume", action="store_true", help="continue from checkpoint.dir's latest checkpoint if "
                       "there is one (else start afresh, saying so). Under `torchrun --max-restarts N` restarted "
                       "workers resume from the checkpoints this run wrote without it, and keep rank 0's SGLang servers")
    train.add_argument("--overwrite", action="store_true", help="logging.dir / checkpoint.dir hold an earlier run: "
                       "delete its metrics and checkpoints and start afresh (without it, or --resume, a used dir is "
                       "refused)")
    plan = sub.add_parser(
        "plan", help="print the resolved parallel layout and per-GPU memory estimate",
        description="The ranks of every TP/PP/EP/CP/DP group (as megatron-core builds them) and the per-GPU memory "
        "of the most loaded rank: parameters, gradients, optimizer state, the KL reference, activations for the "
        "configured recompute and padded length, the peak working set, allocator slack and CUDA/NCCL overhead, "
        "with the assumptions it rests on.",
    )
    from gspo_megatron.plan.layouts import DGX_H100_HOST_GIB, H100_GIB

    plan.add_argument("config")
    plan.add_argument("overrides", nargs="*", help="section.field=value overrides")
    plan.add_argument("--nodes", type=int, default=None, help="nodes (default 1; needs --gpus-per-node)")
    plan.add_argument("--gpus-per-node", type=int, default=0, help="default: $WORLD_SIZE (or 1) ranks in all")
    plan.add_argument("--gpu-memory-gib", type=float, default=H100_GIB,
                      help=f"per-GPU memory as torch reports it (H100 80 GB: {H100_GIB})")
    plan.add_argument("--host-memory-gib", type=float, default=DGX_H100_HOST_GIB,
                      help=f"host memory per node, for optimizer.offload_fraction > 0 (DGX H100: {DGX_H100_HOST_GIB:g})")
    plan.add_argument("--layer-spec", choices=("te", "local"), default="te",
                      help="te: TransformerEngine layers, what GPU runs build (default); local: megatron's local "
                      "spec (torch norms, unfused attention), what CPU runs build")
    from gspo_megatron import score

    score.add_arguments(sub.add_parser("score", help="log-likelihood of responses under a model (JSONL in, JSONL out)"))
    return parser


def main(argv: list[str] | None = None) -> int:
    from gspo_megatron.environment import quiet_start

    quiet_start()  # one line of ours at start-up, not third-party warnings and progress bars
    parser = build_parser()
    # Overrides may also come after options (``plan cfg.yaml --nodes 2 parallel.expert=8``).
    args, extra = parser.parse_known_args(argv)
    stray = [a for a in extra if a.startswith("-") or "=" not in a or not hasattr(args, "overrides")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = list(args.overrides) + extra
    from gspo_megatron.environment import EnvironmentMismatch
    from gspo_megatron.train.startup.config import ConfigError

    from gspo_megatron.parallel import groups

    try:
        if args.command == "score":
            from gspo_megatron import score

            status = score.run(args)
        else:
            status = _train(args) if args.command == "train" else _plan(args)
    except (ConfigError, EnvironmentMismatch) as error:
        # Every rank reads the same config and finds the same error: a node's first rank says it, once per node
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            print(f"gspo-megatron {args.command}: {error}", file=sys.stderr)
        status = 2
    groups.destroy()  # before the interpreter's exit, which may abort a rank holding gloo groups (groups.destroy)
    return status


if __name__ == "__main__":
    sys.exit(main())
