"""Tests of labkit.ranks, the rank launcher.

The ranks run real gloo process groups in child processes; the checks are against closed forms
(the sum of 1..N, the byte count of a float32 tensor, a rank's own number, a tensor's shape) and
against the operating system (is a process id still alive?), not against anything labkit
computes itself. Bad input (a world size, a timeout, arguments fn cannot take) is refused with a
TypeError/ValueError naming the argument before any process starts; a rank that fails, exits,
is killed or hangs is named, with its traceback, never a hang. Fork-only workers are defined
here: a forked rank already has this module.
"""
from __future__ import annotations

import contextlib
import datetime
import importlib
import os
import resource
import signal
import socket
import sys
import threading
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist

from _process_helpers import assert_all_gone
from labkit import _rank_examples as ex
from labkit import ranks as labkit_ranks
from labkit.ranks import MAX_WORLD_SIZE, RankError, RankTimeout, launch


def _pids_written(pid_dir) -> list[int]:
    return [int(p) for f in sorted(pid_dir.iterdir()) for p in f.read_text().split()]


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
    assert_all_gone([r["pid"] for r in first + second])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the port is held on Linux only")
def test_the_group_s_port_is_kept_from_others_until_the_store_binds_it():
    """While ``reserved_port`` holds a port, nobody who binds port 0 gets it (a port probed free
    and closed could be: rank 0 once failed with EADDRINUSE), yet a store can listen on it.
    15,000 binds of port 0, all held, cover more than half of Linux's default ephemeral range
    (32768-60999); a port probed and closed was handed out again within them in 6 tries of 6
    when this was written. (Fewer binds where the process may not open that many files.)"""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < 16_000:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(16_000, hard), hard))
    room = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    held = []
    try:
        with labkit_ranks.reserved_port() as port:
            for _ in range(15_000 if room == resource.RLIM_INFINITY else min(15_000, room - 500)):
                held.append(socket.socket())
                held[-1].bind(("127.0.0.1", 0))
                assert held[-1].getsockname()[1] != port
            store = dist.TCPStore("127.0.0.1", port, 1, True, timeout=datetime.timedelta(seconds=10))
            store.set("k", "v")
            assert store.get("k") == b"v"
    finally:
        for s in held:
            s.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


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
    assert_all_gone(error.pids)


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
    assert_all_gone(info.value.pids)


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
    assert_all_gone(pids + error.pids)


def test_keyboard_interrupt_in_the_parent_kills_every_rank(tmp_path):
    """Check that Ctrl-C while the parent waits leaves no rank (nor its children) running.

    The interrupt comes once both ranks have written their pids (the parent is then waiting for
    them, not importing or forking) and goes to the main thread (``pthread_kill``), as a
    terminal's or Jupyter's interrupt does: ``os.kill(os.getpid())`` from a helper thread may be
    taken by that thread, leaving the main thread asleep in ``wait`` (a flaky RankTimeout under
    load). It is sent again every 2 s until ``launch`` returns, as a user presses Ctrl-C again.
    """
    stop, main = threading.Event(), threading.main_thread().ident

    def interrupt():
        while len(list(tmp_path.glob("rank*.pids"))) < 2:
            if stop.wait(0.05):
                return
        while True:
            signal.pthread_kill(main, signal.SIGINT)
            if stop.wait(2.0):
                return

    sender = threading.Thread(target=interrupt, daemon=True)
    sender.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            launch(ex.hang_on_rank, 2, stuck_rank=1, pid_dir=str(tmp_path), timeout=30)
    finally:
        stop.set()
        sender.join()
    assert_all_gone(_pids_written(tmp_path))


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
    assert_all_gone(error.pids)


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


# ---------------------------------------------------------------- odd sizes, odd results, nested and killed ranks

def _rank_and_size(rank, world_size):
    return rank, world_size, dist.get_world_size()


def _leave(rank, world_size, how):
    if rank == world_size - 1:
        if how == "sys.exit":
            sys.exit(3)
        if how == "SIGKILL":
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "KeyboardInterrupt":
            raise KeyboardInterrupt
    dist.barrier()


def _meta_result(rank, world_size):
    return {"weight": torch.empty(3, 5, dtype=torch.bfloat16, device="meta")}


def _launch_inside(rank, world_size, inner_size):
    return launch(_rank_and_size, inner_size)


def _takes_nothing_more(rank, world_size):
    return rank


@pytest.mark.parametrize("world_size", [1, 3])
def test_one_rank_and_an_odd_number_of_ranks_each_see_their_own_rank(world_size):
    """Check N = 1 and N = 3 (no power of two): rank r returns r, and the group has N ranks."""
    assert launch(_rank_and_size, world_size) == [(r, world_size, world_size) for r in range(world_size)]


def test_a_numpy_integer_world_size_is_accepted():
    """Check np.int64(2) (what arithmetic on a numpy array gives) works like 2."""
    assert launch(_rank_and_size, np.int64(2)) == [(0, 2, 2), (1, 2, 2)]


@pytest.mark.parametrize("how, words", [
    ("sys.exit", "raised SystemExit"),
    ("SIGKILL", "died"),
    ("KeyboardInterrupt", "raised KeyboardInterrupt"),
])
def test_a_rank_that_exits_or_is_killed_is_named_not_its_waiting_peers(how, words):
    """Check the last of 3 ranks leaving (sys.exit, SIGKILL, Ctrl-C inside the rank) is the rank
    blamed, within the grace period: its peers only echo it ("Connection closed by peer")."""
    started = time.monotonic()
    with pytest.raises(RankError, match=f"rank 2 of 3 {words}") as info:
        launch(_leave, 3, how, timeout=20)
    assert info.value.rank == 2
    assert time.monotonic() - started < 10, "waited for the deadline instead of reporting the death"


def test_a_meta_tensor_comes_back_as_a_meta_tensor_of_the_same_shape_and_dtype():
    """Check a rank may return a meta tensor (no data): it was 'cannot be pickled back'."""
    (a, b) = launch(_meta_result, 2)
    for got in (a["weight"], b["weight"]):
        assert (got.device.type, tuple(got.shape), got.dtype) == ("meta", (3, 5), torch.bfloat16)


@pytest.mark.parametrize("args, kwargs", [((), {"rank": 3}), ((7,), {}), ((), {"n": 1})])
def test_arguments_fn_cannot_take_are_refused_before_any_rank_starts(args, kwargs):
    """Check fn(rank, world_size, *args, **kwargs) is bound first: one TypeError naming fn (a
    keyword named rank clashes), not the same error raised by N ranks."""
    started = time.monotonic()
    with pytest.raises(TypeError, match="_takes_nothing_more.*cannot be called as"):
        launch(_takes_nothing_more, 2, *args, **kwargs)
    assert time.monotonic() - started < 1.0


@pytest.mark.parametrize("timeout", [1e15, float("inf"), float("nan")])
def test_a_timeout_no_process_group_can_hold_is_refused(timeout):
    """Check 1e15 s is refused up front (each rank's timedelta overflowed: N OverflowErrors)."""
    with pytest.raises(ValueError, match=r"timeout must be a number of seconds in \(0, 1e\+07\]"):
        launch(_rank_and_size, 2, timeout=timeout)


def test_an_absurd_world_size_is_refused_instead_of_forking_a_million_processes():
    """Check launch(fn, 10**6) is refused at once (it forked processes for minutes, then ran out
    of file descriptors), naming the allowed range."""
    with pytest.raises(ValueError, match=rf"world_size must be an int in \[1, {MAX_WORLD_SIZE}\]"):
        launch(_rank_and_size, 10**6)


@pytest.mark.skipif(sys.platform == "win32", reason="fork-only")
def test_ranks_forked_from_a_process_with_its_own_group_join_theirs(tmp_path):
    """Check a process that made a one-rank gloo group of its own (tools/bench does) can still
    launch: forked ranks inherited a copy and failed ("initialize the default process group
    twice"). This process's group is untouched by the launch."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert launch(_rank_and_size, 2, start_method="fork") == [(0, 2, 2), (1, 2, 2)]
        assert dist.get_world_size() == 1  # still ours
        t = torch.ones(2)
        dist.all_reduce(t)  # and it still works
        assert t.tolist() == [1.0, 1.0]
    finally:
        dist.destroy_process_group()


def test_a_launch_inside_a_rank_runs_on_the_rank_s_own_group_or_is_named():
    """Check a nested launch of the same N runs fn in place on the rank's group (as under
    torchrun), and one of another N is a ValueError naming world_size, shown with its traceback."""
    assert launch(_launch_inside, 2, 2) == [[(0, 2, 2)], [(1, 2, 2)]]
    with pytest.raises(RankError, match=r"ValueError: world_size=3 inside a group of 2 ranks"):
        launch(_launch_inside, 2, 3, timeout=20)

