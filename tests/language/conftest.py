import pytest
import torch

# Every language test runs on the reference interpreter and on the CPU C backend.
TARGETS = ["interp", "c"]


@pytest.fixture(params=TARGETS)
def target(request):
    return request.param


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
