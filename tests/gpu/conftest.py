"""GPU tests: run only where CUDA is available (the lent H200), skipped elsewhere (CI)."""

import pytest
import torch

if not torch.cuda.is_available():
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
