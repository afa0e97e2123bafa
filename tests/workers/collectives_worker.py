"""A torchrun worker: the gloo ring reduce-scatter and all-gather equal torch's own collectives (on 2 ranks also
with the ring's second connection, `add_return_group`).

torchrun --nproc_per_node N tests/workers/collectives_worker.py
"""

import torch
import torch.distributed as dist

from torchacco.parallel import collectives


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    collectives.PIECE_NUMEL = 1 << 14  # several pieces per chunk
    for connections in (1, 2) if world == 2 else (1,):
        if connections == 2:
            collectives.add_return_group(dist.group.WORLD, dist.new_group(backend="gloo"))
        check(rank, world)
    dist.destroy_process_group()


def check(rank: int, world: int) -> None:
    for numel in (world * 70_000, world * (1 << 16) + world * 5):
        for dtype in (torch.float32, torch.bfloat16):
            g = torch.Generator().manual_seed(rank)
            full = torch.randn(numel, generator=g).to(dtype)
            expected = torch.empty(numel // world, dtype=dtype)
            dist.reduce_scatter_tensor(expected, full.clone())
            ours = full.clone()
            shard = ours[rank * (numel // world) : (rank + 1) * (numel // world)]
            collectives.reduce_scatter(shard, ours)  # in place, as the sharded job calls it
            tol = 1e-5 if dtype == torch.float32 else 3e-2  # another summation order
            torch.testing.assert_close(shard, expected, rtol=tol, atol=tol)
            gathered = torch.empty(numel, dtype=dtype)
            dist.all_gather_into_tensor(gathered, expected)
            out = torch.zeros(numel, dtype=dtype)
            out[rank * (numel // world) : (rank + 1) * (numel // world)] = expected
            collectives.all_gather(out, out[rank * (numel // world) : (rank + 1) * (numel // world)])
            assert torch.equal(out, gathered)


if __name__ == "__main__":
    main()
