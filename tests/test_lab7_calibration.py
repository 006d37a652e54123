"""The course's cost model against published training runs (not graded).

The published figures and how each run ran are in ``labkit.reference.lab7`` (each with its
source); ``as_ran`` scores a run's published layout with the choices its paper states, and the
planner (``labkit.lab7.planner.plan``, skipped while exercise 7.1 is a stub) ranks every
configuration its framework offered. What is checked, and how tight (the bounds of issue 35):

* the ZeRO paper's Figure 1 (model states of a 7.5B model on 64 GPUs): exact, to its one printed
  decimal (±0.05 GB);
* every published layout fits the model's memory as it ran, in the GPU's whole memory (the run
  happened; the planner's 10% margin is for runs not yet made), and BLOOM's bytes stay under
  the ~60 GB its run used (the model counts less than a run holds: allocator cache, buffers,
  the embedding stage);
* predicted TFLOP/s per GPU (the paper's own FLOP count over the model's step time) within ±20%
  of every Megatron-LM row, ±30% of BLOOM's "about 150" and of Llama 3's three rows;
* each published layout among the planner's first 10 for its cluster, or within 5% of its
  best. Four rows miss it, each for a term of the model named in its ``xfail`` reason: strict,
  so a change of the model that closes the gap shows here.
"""
from __future__ import annotations

import functools

import pytest

from labkit import cost_model
from labkit.memory_model import static_bytes_per_gpu
from labkit.reference import lab7 as published

GB = 10**9
RUNS = {run.name: run for run in published.published_runs()}
BAND = {"Megatron": 0.20, "BLOOM": 0.30, "Llama": 0.30}
MISSES = {  # the term of the model that decides each (chapter 7 prints the margins)
    "Megatron-LM 18.4B": "T = 8's all-reduces, charged in full, cost more than the interleaved bubble "
                         "of T = 2 with 4 stages",
    "Megatron-LM 39.1B": "T = 8's all-reduces, charged in full, cost more than the interleaved bubble "
                         "of T = 4 with 4 stages",
    "Llama 3 405B, 8,192 GPUs, 8K": "interleaving without recomputation does not fit Korthikanti's "
                                    "activation count (Llama 3's own schedule and deallocation fit it); "
                                    "T4·C4 with ZeRO-1 needs neither recomputation nor T = 8's all-reduces",
    "Llama 3 405B, 16,384 GPUs, 128K": "P = 16 with 16 micro-batches idles more than P = 4 with ZeRO-3 "
                                       "over 512 ranks",
}


def band_of(name):
    return next(v for k, v in BAND.items() if name.startswith(k))


@functools.cache
def scored(name):
    return published.as_ran(RUNS[name])


@functools.cache
def ranked(name):
    from labkit.lab7 import planner

    run = RUNS[name]
    try:
        result = planner.plan(run.model, run.cluster, run.global_batch, margin=0.0,
                              n_runners_up=10**9, **run.space)
    except NotImplementedError:
        pytest.skip("exercise 7.1 not written: the ranking needs the planner")
    return [result.best] + result.runners_up


def test_zero_paper_figure_1():
    """Rajbhandari et al. 2019, Figure 1: 120, 31.4, 16.6, 1.9 GB per GPU (Ψ = 7.5B, N_d = 64)."""
    fig = published.ZERO_FIGURE_1
    for stage, printed in fig["gb"].items():
        got = sum(static_bytes_per_gpu(fig["n_params"], zero_stage=stage, world_size=fig["n_gpus"]).values())
        assert got / GB == pytest.approx(printed, abs=0.05), (
            f"ZeRO-{stage} model states of 7.5B on 64 GPUs: expected {printed} GB (the paper's "
            f"Figure 1), got {got / GB:.3f} GB")


@pytest.mark.parametrize("name", list(RUNS))
def test_published_layout_fits_as_it_ran(name):
    e = scored(name)
    assert e is not None, f"{name}: no configuration of the published layout {RUNS[name].layout} fits in the whole GPU"
    if "memory_gb" in RUNS[name].notes:
        assert e.memory["total"] <= RUNS[name].notes["memory_gb"] * GB, (
            f"{name}: the model counts {e.memory['total'] / GB:.1f} GB, more than the run used")


@pytest.mark.parametrize("name", list(RUNS))
def test_predicted_throughput_within_band(name):
    """The paper's FLOPs per step over the model's step time, against the published TFLOP/s."""
    run, e = RUNS[name], scored(name)
    predicted = run.flops / (e.time.total * run.cluster.n_gpus) / 1e12
    band = band_of(name)
    assert abs(predicted / run.tflops - 1) <= band, (
        f"{name}: the model predicts {predicted:.0f} TFLOP/s per GPU for {e.config.label()}, the "
        f"paper measured {run.tflops}: {predicted / run.tflops:.2f}, outside 1 ± {band}")


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=MISSES[n]))
                                  if n in MISSES else n for n in RUNS])
def test_published_layout_ranks_near_the_top(name):
    """The published layout's first configuration in the planner's order is among its first 10,
    or within 5% of the best's step time."""
    order = ranked(name)
    place, e = cost_model.rank_of_layout(order, *RUNS[name].layout)
    assert e is not None, f"{name}: no configuration of the published layout in the ranking"
    gap = e.time.total / order[0].time.total - 1
    assert place <= 10 or gap <= 0.05, (
        f"{name}: the published layout is #{place} of {len(order)}, {gap:.1%} slower than the "
        f"planner's best {order[0].config.label()}")
