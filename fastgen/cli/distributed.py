"""Data-parallel runs under ``torchrun``: which shard this process owns, and where its part goes.

Each rank writes its own resumable part (``<output>.part-<rank>-of-<world>`` and its index); after
a barrier, rank 0 merges the parts into ``<output>`` in input order and removes them. Ranks only
talk to each other at that barrier, so a slow rank never stalls another's generation.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def part(self, output: Path) -> Path:
        """Where this rank writes: the output itself when alone."""
        if self.size == 1:
            return output
        return output.with_name(f"{output.name}.part-{self.rank}-of-{self.size}")

    def parts(self, output: Path) -> list[Path]:
        return [output.with_name(f"{output.name}.part-{r}-of-{self.size}") for r in range(self.size)]


def from_environment(device: str | None = None) -> World:
    """The torchrun world (RANK/WORLD_SIZE/LOCAL_RANK), joined over gloo on CPU and nccl on CUDA."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return World()
    world = World(int(os.environ["RANK"]), size, int(os.environ.get("LOCAL_RANK", "0")))
    import torch.distributed as dist

    if not dist.is_initialized():
        use_cuda = torch.cuda.is_available() and (device is None or device.startswith("cuda"))
        # Ranks meet only at the end; a long generation must not trip the default 30-minute timeout.
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(days=7))
    return world


def barrier(world: World) -> None:
    if world.size > 1:
        import torch.distributed as dist

        dist.barrier()


def shutdown(world: World) -> None:
    if world.size > 1:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
