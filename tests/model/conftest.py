"""Shared settings for the model tests."""

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    # The models here are tiny: splitting their matmuls across threads costs more than it saves, and on
    # a busy 2-core machine the waiting threads make a 4 ms training step take over 100 ms.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
