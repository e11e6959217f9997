"""run_ranks on CUDA: the ranks join NCCL through the parent's rendezvous store (one GPU is enough to show it;
tests/gpu/test_tp_gpu.py runs two)."""

from __future__ import annotations

import pytest
import torch

from mxc.runtime.ranks import run_ranks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def _worker(rank, world_size, device, out):
    import torch.distributed as dist

    assert dist.get_backend() == "nccl" and dist.get_world_size() == world_size
    x = torch.arange(4, dtype=torch.float32, device=device) * (rank + 1)
    dist.all_reduce(x)
    if rank == 0:
        torch.save((device, x.cpu()), out)


@pytest.mark.parametrize("world_size", [1, 2])
def test_ranks_join_nccl_through_the_rendezvous_store(world_size, tmp_path):
    if torch.cuda.device_count() < world_size:
        pytest.skip(f"needs {world_size} GPUs")
    run_ranks(_worker, world_size, "cuda", str(tmp_path / "out.pt"))
    device, x = torch.load(tmp_path / "out.pt", weights_only=True)
    assert device == "cuda:0"
    assert torch.equal(x, torch.arange(4, dtype=torch.float32) * sum(range(1, world_size + 1)))
