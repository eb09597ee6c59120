"""Tensor parallelism: the target sharded with transformers' TP plan over N processes.

How it runs (SPMD): every rank runs the same engine loop on the same inputs. The target's
forwards carry transformers' collectives (an all-reduce after each row-wise layer, the logits
gathered), so every rank sees the same logits and commits the same tokens; the draft is small
and replicated. Rank 0 alone reads input over the network and writes output; the other ranks
follow. Ranks stay in lockstep because nothing the loop decides depends on the rank:
- a sampled request's seed (its noise is keyed by seed and position): rank 0's is broadcast
  (`sync_seeds`);
- decisions taken from a clock (the measured prefill chunk; `-k auto`'s drafts asked for, early
  stops and verify widths, step.py): rank 0's value is broadcast (`agree`); any new timing-based
  choice must go through `agree` too;
- the server's requests, cancellations and shutdown: rank 0 broadcasts them each iteration
  (engine/lockstep.py).

Launch: `batchspec ... --tp N` starts itself again under torch's elastic launcher
(`python -m torch.distributed.run --standalone --nproc-per-node N`) unless it already runs under
one (torchrun sets WORLD_SIZE); across nodes, start it with torchrun yourself. CPU ranks talk over
gloo, CUDA ranks over NCCL (objects over gloo).

Caches: each rank holds num_key_value_heads / N heads of the target (kv.kv_heads reads the
model's `distributed_config`); the draft's caches are whole.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import torch
import torch.distributed as dist

from ..core.errors import BatchspecError

LAUNCHER_ENV = "WORLD_SIZE"  # set by torchrun / torch.distributed.run for every rank


def active() -> bool:
    """Whether this process is one rank of a tensor-parallel group of more than one."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if active() else 0


def is_leader() -> bool:
    """Rank 0 (or a single process): the one that reads the network and writes output."""
    return rank() == 0


def check(config, n: int) -> None:
    """Refuse, with a clear message, a target that cannot be split over n ranks."""
    if n < 1:
        raise BatchspecError(f"--tp must be >= 1, got {n}")
    if n == 1:
        return
    kind = getattr(config, "model_type", type(config).__name__)
    if not getattr(config, "base_model_tp_plan", None):
        raise BatchspecError(f"the target ({kind}) has no tensor-parallel plan in transformers; --tp needs one")
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads % n or kv_heads % n:
        raise BatchspecError(
            f"--tp {n}: the target ({kind}) has {heads} attention heads and {kv_heads} KV heads; "
            f"both must be divisible by {n}"
        )


def launch(n: int, argv: list[str]) -> int | None:
    """Under a launcher: check its world size and return None (this process is a rank). Else
    run `batchspec argv` as n ranks of torch.distributed.run on this machine and return its exit
    status. SIGTERM and SIGINT go to the ranks themselves, not to the launcher's agent (which
    would kill them and exit 1): a server then stops gracefully and the launcher exits 0."""
    if LAUNCHER_ENV in os.environ:
        world = int(os.environ[LAUNCHER_ENV])
        if world != n:
            raise BatchspecError(f"--tp {n} but the launcher started {world} processes (--nproc-per-node)")
        return None
    import psutil

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}"]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // n)))}
    agent = subprocess.Popen([*cmd, "-m", "batchspec.cli", *argv], env=env)

    def forward(sig, frame):
        try:
            for child in psutil.Process(agent.pid).children():
                child.send_signal(sig)
        except psutil.Error:  # the launcher or a rank has exited already
            pass

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    return agent.wait()


def init(device: str | None) -> str:
    """Join the process group (gloo on CPU; NCCL for CUDA tensors, gloo for objects) and return
    this rank's device. Outside a launcher: nothing to join."""
    if LAUNCHER_ENV not in os.environ:
        return device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = (device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local)
    if not dist.is_initialized():
        dist.init_process_group(backend="cpu:gloo,cuda:nccl" if cuda else "gloo")
    return f"cuda:{local}" if cuda else "cpu"


def agree(value):
    """Rank 0's `value` on every rank (a picklable object); the value itself when not parallel.
    Every rank must call it at the same point of the loop."""
    if not active():
        return value
    box = [value if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def sync_seeds(seqs) -> None:
    """Give every rank rank 0's seed of each sampled sequence (an unseeded request draws its seed
    from the operating system, which differs per rank)."""
    if not active():
        return
    for seq, seed in zip(seqs, agree([s.seed for s in seqs])):
        seq.seed = seed


def from_pretrained_options(n: int) -> dict:
    """`from_pretrained` keywords that shard a model over n ranks with its TP plan (each rank then
    loads only its shard); none for n = 1."""
    if n <= 1:
        return {}
    from transformers.distributed import DistributedConfig

    return {"distributed_config": DistributedConfig(tp_size=n)}


def finish() -> None:
    """Leave the process group (at exit)."""
    if dist.is_initialized():
        dist.destroy_process_group()
