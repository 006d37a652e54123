"""Tests of labkit.ranks (the rank launcher) and labkit.comm_count (the communication counter).

The ranks run real gloo process groups in child processes; the checks are against closed forms
(the sum of 1..N, the byte count of a float32 tensor, the ring formulas) and against the
operating system (is a process id still alive?), not against anything labkit computes itself.
"""
from __future__ import annotations

import importlib
import os
import signal
import sys
import threading
import time

import pytest
import torch

from labkit import _rank_examples as ex
from labkit import ranks as labkit_ranks
from labkit.ranks import RankError, RankTimeout, launch


def _alive(pid: int) -> bool:
    """True if `pid` runs (a zombie, dead but not yet reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc (macOS): ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def _pids_written(pid_dir) -> list[int]:
    return [int(p) for f in sorted(pid_dir.iterdir()) for p in f.read_text().split()]


def _assert_all_gone(pids, within: float = 2.0) -> None:
    deadline = time.monotonic() + within  # an orphaned grandchild is reaped by init, not by us
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if _alive(p)], f"left behind: {pids}"


# Fork-only workers: a forked child already has this module, so they need not be importable.
def _return_grad_tensor(rank, world_size):
    return torch.full((3,), float(rank), requires_grad=True) * 2  # a non-leaf that needs grad


def _exit_without_report(rank, world_size):
    if rank == 1:
        os._exit(7)
    torch.distributed.all_reduce(torch.ones(1))


@pytest.mark.parametrize("world_size", [2, 4])
def test_results_come_back_in_rank_order(world_size):
    """Check that rank r's return value is element r, and the all-reduce equals 1 + ... + N."""
    results = launch(ex.all_reduce_ranks, world_size, n=5)
    assert [r["rank"] for r in results] == list(range(world_size))
    expected = torch.full((5,), world_size * (world_size + 1) / 2)
    for r in results:
        torch.testing.assert_close(r["sum"], expected)
    assert len({r["pid"] for r in results} | {os.getpid()}) == world_size + 1  # N new processes


def test_two_launches_in_a_row_use_fresh_processes():
    """Check that a second launch works after the first (new port, new processes)."""
    first = launch(ex.all_reduce_ranks, 2)
    second = launch(ex.all_reduce_ranks, 2)
    assert [r["sum"][0].item() for r in first + second] == [3.0] * 4
    assert not {r["pid"] for r in first} & {r["pid"] for r in second}
    _assert_all_gone([r["pid"] for r in first + second])


def test_tensors_come_back_detached_on_cpu():
    """Check that a tensor that requires grad is returned as plain data."""
    results = launch(_return_grad_tensor, 2)
    assert not results[1].requires_grad
    torch.testing.assert_close(results[1], torch.full((3,), 2.0))


def test_failing_rank_raises_rank_error_with_its_traceback():
    """Check that a rank's exception reaches the parent quickly, naming the rank and the function,
    while the other rank, blocked in an all-reduce with the dead one, is stopped."""
    started = time.monotonic()
    with pytest.raises(RankError) as info:
        launch(ex.fail_on_rank, 2, bad_rank=1, message="boom on purpose", timeout=30)
    elapsed = time.monotonic() - started
    error = info.value
    assert elapsed < 10, f"took {elapsed:.1f} s"
    assert not isinstance(error, RankTimeout)
    assert error.rank == 1 and error.exc_type == "NotImplementedError"
    assert str(error).startswith("rank 1 of 2 raised NotImplementedError")
    assert "fail_on_rank" in error.child_traceback and "fail_on_rank" in str(error)
    assert "Traceback (most recent call last)" in str(error)
    _assert_all_gone(error.pids)


def test_exercise_stub_message_is_kept_as_the_last_line():
    """Check that an unattempted exercise reads as "NotImplementedError: exercise ..." at the end,
    the text the grader looks for."""
    stub = "exercise 9.9: sum the gradients over ranks (labs/09_demo.ipynb)"
    with pytest.raises(RankError) as info:
        launch(ex.fail_on_rank, 2, bad_rank=0, message=stub)
    assert str(info.value).splitlines()[-1] == f"NotImplementedError: {stub}"
    assert info.value.rank == 0


def test_rank_that_dies_silently_is_reported():
    """Check that a rank that exits without a report (os._exit, a kill) raises RankError."""
    with pytest.raises(RankError) as info:
        launch(_exit_without_report, 2, timeout=30)
    assert info.value.rank == 1 and info.value.exc_type is None
    assert "exit code 7" in str(info.value)
    _assert_all_gone(info.value.pids)


def test_hanging_rank_raises_rank_timeout_at_the_deadline(tmp_path):
    """Check that a rank that never returns (while rank 0 waits for it in a barrier) is killed at
    the deadline, with its helper process, and reported with where it was stuck."""
    started = time.monotonic()
    with pytest.raises(RankTimeout) as info:
        launch(ex.hang_on_rank, 2, stuck_rank=1, pid_dir=str(tmp_path), timeout=3.0)
    elapsed = time.monotonic() - started
    error = info.value
    assert isinstance(error, TimeoutError) and isinstance(error, RankError)
    assert 2.5 < elapsed < 8, f"took {elapsed:.1f} s"
    assert error.ranks == [0, 1] and error.rank == 1
    assert str(error).startswith("ranks 0, 1 of 2 had not finished")
    assert "hang_on_rank" in error.child_traceback  # rank 1's stack at the deadline
    assert "barrier" in str(error)  # rank 0 gave up in the barrier
    pids = _pids_written(tmp_path)
    assert len(pids) == 3  # two ranks and rank 1's `sleep` helper
    _assert_all_gone(pids + error.pids)


def test_keyboard_interrupt_in_the_parent_kills_every_rank(tmp_path):
    """Check that Ctrl-C while the parent waits leaves no rank (nor its children) running."""
    timer = threading.Timer(1.5, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            launch(ex.hang_on_rank, 2, stuck_rank=1, pid_dir=str(tmp_path), timeout=30)
    finally:
        timer.cancel()
    _assert_all_gone(_pids_written(tmp_path))


def test_spawn_runs_an_importable_worker():
    """Check the spawn path (used once CUDA is initialised in the parent) end to end."""
    results = launch(ex.all_reduce_ranks, 2, start_method="spawn", timeout=120)
    assert [r["sum"][0].item() for r in results] == [3.0, 3.0]


def test_start_method_is_forkserver_once_cuda_is_initialised(monkeypatch):
    """Check the rule: fork while CUDA is untouched in the parent, forkserver once it is initialised."""
    assert labkit_ranks._default_start_method() == "fork"  # POSIX test machines, CPU torch
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert labkit_ranks._default_start_method() == "forkserver"


def test_spawn_refuses_a_function_it_cannot_import():
    """Check that spawn explains, before starting anything, why a local function cannot run."""
    def local_worker(rank, world_size):
        return rank

    with pytest.raises(ValueError, match="module level"):
        launch(local_worker, 2, start_method="spawn")
    assert launch(local_worker, 2, start_method="fork") == [0, 1]  # fork needs no import


@pytest.mark.parametrize("world_size", [2, 4])
def test_count_comm_counts_calls_and_bytes_exactly(world_size):
    """Check calls and bytes of one all-reduce of 1000 float32 (B = 4000 bytes), one all-gather
    and one reduce-scatter of N·1000 (N·B), one send/recv of B, against the ring formulas
    2(N-1)/N·B (all-reduce) and (N-1)/N·(N·B) (all-gather, reduce-scatter)."""
    n, B = 1000, 4000
    results = launch(ex.count_basic_comm, world_size, n=n)
    for rank, counts in enumerate(results):
        p2p = {0: {"send": B}, 1: {"recv": B}}.get(rank, {})
        collectives = {"all_reduce": B, "all_gather_into_tensor": world_size * B,
                       "reduce_scatter_tensor": world_size * B}
        assert counts["calls"] == {op: 1 for op in collectives | p2p}
        assert counts["bytes_sent"] == collectives | p2p
        ring = counts["ring_bytes"]
        assert ring["all_reduce"] == pytest.approx(2 * (world_size - 1) / world_size * B)
        assert ring["all_gather_into_tensor"] == pytest.approx((world_size - 1) * B)
        assert ring["reduce_scatter_tensor"] == pytest.approx((world_size - 1) * B)
        assert ring.get("send", 0) == (B if rank == 0 else 0) and ring.get("recv", 0) == 0


@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
def test_a_rank_changes_only_its_own_copy_of_the_arguments(start_method):
    """Check that arguments go to each rank by value under both default start methods: a rank
    that adds rank+1 in place to a tensor, to a module's parameters and writes to a dict sees its
    change, the parent's objects keep their values (forkserver and spawn pickle the arguments,
    and must not hand out shared memory)."""
    tensor, model, state = torch.zeros(4), torch.nn.Linear(3, 2), {"touched_by": None}
    weight = model.weight.detach().clone()
    results = launch(ex.change_arguments_in_place, 2, tensor, model, state,
                     start_method=start_method, timeout=120)
    for rank, r in enumerate(results):
        torch.testing.assert_close(r["tensor"], torch.full((4,), float(rank + 1)),
                                   msg=lambda m: f"rank {rank}'s own tensor: {m}")
        torch.testing.assert_close(r["weight"], weight + rank + 1)
        assert r["state"]["touched_by"] == rank
    assert torch.equal(tensor, torch.zeros(4)), f"the parent's tensor changed to {tensor.tolist()}"
    assert torch.equal(model.weight.detach(), weight), "the parent's model was trained by a rank"
    assert state == {"touched_by": None} and not tensor.is_shared()


def test_start_method_never_forks_when_ranks_may_use_cuda(monkeypatch):
    """Check the rule: fork for CPU ranks; forkserver for nccl, a CUDA `device` hint, a CUDA
    tensor among the arguments, or CUDA initialised in the parent."""
    from labkit.ranks import start_method_for

    assert start_method_for() == "fork"
    assert start_method_for("gloo", (torch.zeros(2),), {"device": "cpu"}) == "fork"
    assert start_method_for("nccl") == "forkserver"
    assert start_method_for("gloo", (), {"device": "cuda"}) == "forkserver"
    assert start_method_for("gloo", (), {"device": torch.device("cuda", 1)}) == "forkserver"
    assert start_method_for("gloo", (torch.empty(2, device="meta"), "cuda:0")) == "forkserver"
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert start_method_for() == "forkserver"


def test_spawn_explains_arguments_it_cannot_copy():
    """Check that an argument that cannot be pickled is refused, named, before any rank starts."""
    with pytest.raises(TypeError, match="cannot copy the arguments"):
        launch(ex.all_reduce_ranks, 2, n=lambda: 4, start_method="spawn")


@pytest.mark.parametrize("kwargs, error, words", [
    ({"world_size": 0}, ValueError, r"world_size must be an int in \[1, 64\]"),
    ({"world_size": -2}, ValueError, r"world_size must be an int in \[1, 64\]"),
    ({"world_size": 2.0}, TypeError, "world_size must be an int"),
    ({"world_size": True}, TypeError, "world_size must be an int"),
    ({"timeout": 0}, ValueError, "timeout must be"),
    ({"timeout": -1.0}, ValueError, "timeout must be"),
    ({"timeout": float("nan")}, ValueError, "timeout must be"),
    ({"timeout": "60"}, TypeError, "timeout must be"),
    ({"backend": "mpi"}, ValueError, r"backend must be one of \('gloo', 'nccl'\)"),
    ({"start_method": "thread"}, ValueError, "start_method must be one of"),
    ({"fn": 3}, TypeError, "fn must be a callable"),
])
def test_launch_refuses_bad_input_before_starting_anything(kwargs, error, words):
    """Check issue 7's cases: each bad argument raises, naming it and what is allowed, at once."""
    call = {"fn": ex.all_reduce_ranks, "world_size": 2, **kwargs}
    started = time.monotonic()
    with pytest.raises(error, match=words):
        launch(call.pop("fn"), call.pop("world_size"), **call)
    assert time.monotonic() - started < 1.0, "refused only after starting ranks"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_launch_refuses_nccl_without_cuda():
    with pytest.raises(ValueError, match="backend='nccl' needs CUDA"):
        launch(ex.all_reduce_ranks, 2, backend="nccl")


def test_both_spellings_of_gather_and_scatter_are_counted_the_same():
    """Check that torch 2.13's new names (all_gather_single, reduce_scatter_single) and the old
    ones (all_gather_into_tensor, reduce_scatter_tensor) count as the same op with the same bytes."""
    old, new = launch(ex.count_both_spellings, 2)
    assert old == new, f"old names counted {old}, new names {new}"
    assert old["calls"] == {"all_gather_into_tensor": 1, "reduce_scatter_tensor": 1}


def test_the_rank_blamed_at_the_deadline_is_the_one_still_inside_the_function():
    """Issue 27.9: 8 ranks, rank 7 asleep, ranks 0-6 returned at once and wait in launch's
    closing barrier, where they give up first (the process-group timeout) and see their peers
    vanish ("Connection closed by peer"). The error must be a RankTimeout naming rank 7 alone,
    not a RankError of a barrier echo nor the lowest rank still alive."""
    with pytest.raises(RankError) as info:
        launch(ex.return_unless_rank, 8, stuck_rank=7, timeout=6.0)
    error = info.value
    assert isinstance(error, RankTimeout), f"expected RankTimeout, got {type(error).__name__}: {error}"
    assert (error.rank, error.ranks) == (7, [7]), f"blamed rank {error.rank} of {error.ranks}"
    assert "return_unless_rank" in error.child_traceback  # rank 7's stack at the deadline
    assert "ranks 0, 1, 2, 3, 4, 5, 6 had returned" in str(error)
    _assert_all_gone(error.pids)


def test_nccl_with_more_ranks_than_gpus_is_refused_before_any_rank_starts(monkeypatch):
    """Check that backend='nccl' with N ranks on fewer GPUs says why (NCCL refuses two ranks on
    one GPU) at once, instead of ranks crashing in init_process_group (a 1-GPU Colab, faked)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    started = time.monotonic()
    with pytest.raises(ValueError, match=r"one GPU per rank: world_size=2 ranks, and this machine has 1 GPU"):
        launch(ex.all_reduce_ranks, 2, backend="nccl")
    assert time.monotonic() - started < 1.0, "refused only after starting ranks"


def test_forkserver_ranks_come_from_one_zygote_that_follows_the_environment(monkeypatch):
    """Check the start-up cost fix: under forkserver (the default once CUDA is initialised) every
    rank of every launch is forked from the same zygote process (which imported torch once),
    not started as a fresh interpreter; and a variable set in os.environ after the zygote
    started still reaches the ranks (the zygote is started again)."""
    first = launch(ex.where_started, 2, start_method="forkserver", timeout=120)
    second = launch(ex.where_started, 2, start_method="forkserver", timeout=120)
    zygote = labkit_ranks._zygote_pid()
    assert {r["ppid"] for r in first + second} == {zygote}, f"parents {first + second}, zygote {zygote}"
    assert len({r["pid"] for r in first + second}) == 4  # new ranks every launch
    monkeypatch.setenv("LABKIT_EXAMPLE", "set after the zygote started")
    third = launch(ex.where_started, 2, start_method="forkserver", timeout=120)
    assert [r["env"] for r in third] == ["set after the zygote started"] * 2
    assert {r["ppid"] for r in third} == {labkit_ranks._zygote_pid()} != {zygote}


def test_a_function_imported_before_its_module_was_reloaded_runs_its_new_code(tmp_path, monkeypatch):
    """Issue 28.3: under Colab's %autoreload 2 (IPython 7.34) an edited module is reloaded, and
    a name imported before the edit keeps the old function object, which pickle refuses ("it's
    not the same object as ..."). Simulated here as autoreload does it: reload the module,
    keep the old objects. The launch must send the module's current definitions, of the
    function and of a class among the arguments, and the ranks must run the new code."""
    module = tmp_path / "edited_worker.py"
    module.write_text("class Scale:\n    factor = 1\n\n"
                      "def work(rank, world_size, scale):\n    return ('v1', rank * scale.factor)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    edited = importlib.import_module("edited_worker")
    old_work, old_scale = edited.work, edited.Scale()
    module.write_text("class Scale:\n    factor = 10\n\n"
                      "def work(rank, world_size, scale):\n    return ('v2', rank * scale.factor)\n")
    importlib.invalidate_caches()
    try:
        importlib.reload(edited)
        assert old_work is not edited.work and type(old_scale) is not edited.Scale
        results = launch(old_work, 2, old_scale, start_method="forkserver", timeout=120)
    finally:
        sys.modules.pop("edited_worker", None)
    assert results == [("v2", 0), ("v2", 10)], f"ranks returned {results}"
