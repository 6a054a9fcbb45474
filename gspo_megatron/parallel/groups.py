"""Process groups: torch.distributed start-up and Megatron-Core's model-parallel layout."""

from __future__ import annotations

import os
import random
import socket
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from gspo_megatron.environment import check_torch_fits_machine
from gspo_megatron.parallel import control


@dataclass(frozen=True)
class Layout:
    """A parallel layout. ``data`` is derived: world / (tensor * pipeline * context)."""

    tensor: int = 1
    pipeline: int = 1
    expert: int = 1
    context: int = 1
    expert_tensor: int | None = None  # None: the same as ``tensor`` (megatron's default)
    sequence_parallel: bool = False
    # Uneven pipeline stages (megatron's num_layers_in_first/last_pipeline_stage): the first / last stage holds
    # this many layers and the other stages split the rest evenly. None: an even split. For layer counts that no
    # stage count divides (DeepSeek-V3 and Kimi-K2 have 61), or a lighter first / last stage (embedding, loss).
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None

    @classmethod
    def of(cls, parallel) -> "Layout":
        """The layout of a config's ``parallel`` section (``train.startup.config.ParallelConfig``, read by attribute:
        this module imports no config); sequence parallelism only where TP > 1."""
        return cls(tensor=parallel.tensor, pipeline=parallel.pipeline, expert=parallel.expert, context=parallel.context,
                   expert_tensor=parallel.expert_tensor,
                   sequence_parallel=parallel.sequence_parallel and parallel.tensor > 1,
                   first_stage_layers=parallel.first_stage_layers, last_stage_layers=parallel.last_stage_layers)

    def stage_layers(self, num_layers: int) -> list[int]:
        """Layers per pipeline stage, first to last (megatron's split). Sizes that do not add up are
        ``model.layout_check``'s to report; here the remainder goes to no stage."""
        first, last, pp = self.first_stage_layers, self.last_stage_layers, self.pipeline
        if pp == 1:
            return [num_layers]
        middle = pp - (first is not None) - (last is not None)
        rest = num_layers - (first or 0) - (last or 0)
        each = rest // middle if middle > 0 else 0
        stages = [each] * pp
        if first is not None:
            stages[0] = first
        if last is not None:
            stages[-1] = last
        return stages

    def stage_split_problem(self, num_layers: int, names: tuple[str, str, str, str]) -> str | None:
        """Why the layers cannot be split over the stages (each stage at least one layer, the counts adding up),
        or None. ``names``: how the caller calls (layers, pipeline size, first-stage layers, last-stage layers)."""
        layers_name, pp_name, first_name, last_name = names
        pp, first, last = self.pipeline, self.first_stage_layers, self.last_stage_layers
        if first is None and last is None:
            if pp > 1 and num_layers % pp:
                return (f"{layers_name}={num_layers} is not divisible by {pp_name}={pp}: use a {pp_name} that divides "
                        f"it, or uneven stages ({first_name} / {last_name})")
            return None
        given = ", ".join(f"{name}={value}" for name, value in ((first_name, first), (last_name, last))
                          if value is not None)
        if pp == 1:
            return f"{given} with {pp_name}=1: uneven stages need pipeline > 1; unset them"
        if any(value is not None and value < 1 for value in (first, last)):
            return f"{given}: a stage needs at least one layer"
        middle = pp - (first is not None) - (last is not None)
        rest = num_layers - (first or 0) - (last or 0)
        if middle == 0 and rest != 0:
            return (f"{given} hold {num_layers - rest} layers but {layers_name}={num_layers}: with {pp_name}={pp} "
                    f"they must add up to {num_layers}")
        if middle > 0 and (rest < middle or rest % middle):
            return (f"{layers_name}={num_layers} minus {given} leaves {rest} layers for the other {middle} stage(s), "
                    f"which must split them evenly with at least one each: change the first / last stage's layers "
                    f"or {pp_name}")
        return None

    def stage_range(self, num_layers: int, stage: int) -> range:
        """The global (0-based) layer numbers of pipeline ``stage``."""
        counts = self.stage_layers(num_layers)
        start = sum(counts[:stage])
        return range(start, start + counts[stage])

    def world_size_ok(self, world_size: int) -> str | None:
        model = self.tensor * self.pipeline * self.context
        if world_size % model:
            return f"world size {world_size} is not divisible by tensor*pipeline*context = {model}"
        etp = self.expert_tensor or self.tensor
        if world_size % (self.expert * etp * self.pipeline):
            return (
                f"world size {world_size} is not divisible by expert*expert_tensor*pipeline = "
                f"{self.expert * etp * self.pipeline}"
            )
        return None


def add_layout_arguments(parser, verb: str) -> None:
    """--tp/--pp/--ep/--etp on a command-line tool; ``verb`` says what the layout is for ("convert under")."""
    parser.add_argument("--tp", type=int, default=1, help=f"tensor-parallel size to {verb}")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size")
    parser.add_argument("--etp", type=int, default=None, help="expert-tensor-parallel size (default: --tp)")
    parser.add_argument("--first-stage-layers", type=int, default=None,
                        help="layers of the first pipeline stage (uneven stages; default: an even split)")
    parser.add_argument("--last-stage-layers", type=int, default=None,
                        help="layers of the last pipeline stage (uneven stages; default: an even split)")


def layout_from_args(args) -> Layout:
    """The Layout of ``add_layout_arguments``'s options (sequence parallelism whenever TP > 1)."""
    return Layout(tensor=args.tp, pipeline=args.pp, expert=args.ep, expert_tensor=args.etp,
                  sequence_parallel=args.tp > 1, first_stage_layers=args.first_stage_layers,
                  last_stage_layers=args.last_stage_layers)


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


# Where ``free_port`` looks: below the kernel's ephemeral range (ip_local_port_range, 32768-60999 by default), from
# which every outgoing connection (gloo's pairs, HTTP clients, ZMQ) takes its local port. A port picked inside it
# (a bind to port 0) was taken by such a connection before torchrun's store bound it (CI on 65b8972: EADDRINUSE
# for MASTER_PORT 35217); below it only another explicit pick can collide, and picks are spread over ~12,000 ports.
_PICK_SPAN = 12_000
_PICKER = random.SystemRandom()  # not the seeded module RNG: seeded processes would pick the same sequence


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port free on this host now (the world group's MASTER_PORT, a server's, a weight-sync group's), picked
    below the ephemeral range so that no outgoing connection takes it before its owner binds it. Checked on every
    address (0.0.0.0), which a port bound on the loopback alone also fails."""
    high = _ephemeral_low()
    low = max(1024, high - _PICK_SPAN)
    for _ in range(200):
        port = _PICKER.randrange(low, high)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # that range full: any port the kernel gives
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(backend: str | None = None, timeout_s: float | None = None,
                     control_timeout_s: float | None = None) -> None:
    """Start torch.distributed from the torchrun environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT), and the
    gloo control group (``parallel.control``) where ranks wait for rank 0's solo work.

    ``timeout_s`` bounds every collective of the world group (and, through ``init_model_parallel``, of
    megatron's groups): on NCCL its watchdog aborts the job past it. ``control_timeout_s`` is the control
    group's. None: torch's defaults (10 minutes for NCCL, 30 for gloo). A single process without the torchrun
    variables becomes a world of one on loopback. A machine with GPUs that this torch cannot use is refused here,
    before any group starts (``environment.check_torch_fits_machine``).
    """
    if dist.is_initialized():
        control.init(control_timeout_s)
        _wait_for_every_rank_to_join()
        return
    check_torch_fits_machine()
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(free_port())
    backend = backend or default_backend()
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
    dist.init_process_group(backend=backend, timeout=timeout, **_attempt_store(timeout))
    control.init(control_timeout_s)
    _wait_for_every_rank_to_join()


def _attempt_store(timeout: timedelta | None) -> dict:
    """In a worker torchrun restarted, the store arguments of ``init_process_group``: the agent's store under a prefix
    of this attempt; else none (``env://``, as torch does it).

    torchrun's workers share its rendezvous store (TORCHELASTIC_USE_AGENT_STORE=True), one for every attempt, and
    torch's ``env://`` rendezvous adds no prefix per attempt: a restarted worker finds the failed attempt's keys
    (gloo's addresses of the dead ranks) and waits, connecting to them, until the timeout.
    """
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != str(True) or int(env.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0:
        return {}
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), int(env["WORLD_SIZE"]), is_master=False,
                          timeout=timeout or timedelta(minutes=30))
    return {"store": dist.PrefixStore(f"gspo_attempt_{env['TORCHELASTIC_RESTART_COUNT']}", store),
            "rank": int(env["RANK"]), "world_size": int(env["WORLD_SIZE"])}


def init_model_parallel(layout: Layout, seed: int = 1234, timeout_s: float | None = None) -> None:
    """Build Megatron-Core's TP/PP/EP/CP/DP groups for ``layout`` and seed its RNG tracker.

    ``timeout_s``: the groups' collective timeout (None: megatron's default, 30 minutes). On a machine without
    CUDA this first applies ``patches.megatron_cpu``.
    """
    from patches import megatron_cpu

    megatron_cpu.apply()
    from megatron.core import parallel_state, tensor_parallel

    problem = layout.world_size_ok(dist.get_world_size())
    if problem:
        raise ValueError(f"parallel layout {layout}: {problem}")
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tensor,
        pipeline_model_parallel_size=layout.pipeline,
        context_parallel_size=layout.context,
        expert_model_parallel_size=layout.expert,
        expert_tensor_parallel_size=layout.expert_tensor,
        **({} if timeout_s is None else {"distributed_timeout_minutes": timeout_s / 60}),
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    _wait_for_every_rank_to_join()


def _wait_for_every_rank_to_join() -> None:
    """Return from creating groups only once every rank has created its own.

    A gloo group's creation ends in a handshake with each peer. A rank that returned early and then tore its groups
    down at once (a job with no collective of its own, a command refusing its input) closed connections that a
    slower peer was still completing, which failed there: "Gloo connectFullMesh failed ... Connection closed by
    peer" (seen in CI)."""
    control.barrier()


def destroy() -> None:
    """Tear down Megatron's groups and every torch.distributed group (local, no collective).

    A command that ran collectives calls it before it returns: a gloo group left to the interpreter's exit has its
    worker threads destroyed during finalization, which can abort a rank that finished its work ("terminate called
    without an active exception", SIGABRT; pytorch/pytorch#190489), as one of four colocated ranks did in CI."""
    import sys

    parallel_state = sys.modules.get("megatron.core.parallel_state")  # not imported: no megatron groups to drop
    if parallel_state is not None and parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    control.reset()
