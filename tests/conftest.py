"""Shared test set-up: one torch thread, a fixed seed, pytester for the grading tests, and on a
GPU machine a short report of the tests that need CUDA (what `make test-gpu` shows)."""
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
    config._cuda_tests = {}  # nodeid -> outcome, for the tests that skip without CUDA


def _needs_cuda(item) -> bool:
    return any("needs CUDA" in str(m.kwargs.get("reason", "")) for m in item.iter_markers("skipif"))


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _needs_cuda(item):
            config._cuda_tests[item.nodeid] = "not run"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    tests = item.config._cuda_tests
    if item.nodeid in tests and (report.when == "call" or report.outcome != "passed"):
        tests[item.nodeid] = report.outcome


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    tests = getattr(config, "_cuda_tests", {})
    if not tests or not torch.cuda.is_available():
        return
    tr = terminalreporter
    tr.section("tests that need CUDA")
    tr.write_line(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
                  f"CUDA {torch.version.cuda}")
    for nodeid, outcome in sorted(tests.items()):
        tr.write_line(f"  {outcome:<8} {nodeid}")
    counts = {o: sum(v == o for v in tests.values()) for o in sorted(set(tests.values()))}
    tr.write_line("  " + ", ".join(f"{n} {o}" for o, n in counts.items()))
