"""Shared test set-up: one torch thread, a fixed seed, and pytester for the grading tests."""
import pytest
import torch

pytest_plugins = ["pytester"]


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


def pytest_configure(config):
    # One thread: the tensors here are tiny, and on a shared 2-core machine a second thread
    # makes small steps many times slower, never faster.
    torch.set_num_threads(1)
