"""Test set-up: choose compiled (CUDA) or interpreted (CPU) Triton before any kernel import."""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # Triton reads this when a kernel is defined; kernel modules are imported later, lazily.
    os.environ["TRITON_INTERPRET"] = "1"

DEVICE = torch.device("cuda") if HAS_CUDA else torch.device("cpu")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU machine; see README)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device() -> torch.device:
    return DEVICE
