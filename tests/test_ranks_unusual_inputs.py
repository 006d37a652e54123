"""labkit.ranks under inputs and situations its main tests do not try (issue 27's class, toolkit side).

Each case either works (checked against the plain value: the rank's number, the tensor's shape) or
is refused at once with a TypeError/ValueError naming the argument, before any process starts.
Fork-only workers are defined here: a forked rank already has this module.
"""
from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist

from labkit.ranks import MAX_WORLD_SIZE, RankError, launch


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

