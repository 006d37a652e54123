"""Shared test set-up: one thread (2-core CI), a fixed seed, and pytester for the grading tests."""
import pytest
import torch

pytest_plugins = ["pytester"]


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


def pytest_configure(config):
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
