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
  of every Megatron-LM row, ±30% of BLOOM's "about 150", of Llama 3's three rows and of the runs
  added after the model was written, without changing it: Korthikanti et al. 2022's nine
  (Table 5, sequence parallelism with selective recomputation and full recomputation, and the
  530B model on 2,240 GPUs) and MT-NLG 530B's three cluster sizes;
* each published layout among the planner's first 10 for its cluster, or within 5% of its
  best. Four rows miss it, each for a term of the model named in its ``xfail`` reason: strict,
  so a change of the model that closes the gap shows here.
* DeepSeek-V3's pre-training (an MoE run, 64-way expert parallelism across 8 nodes): the model
  leaves out what the run is known for — DualPipe's overlap of the all-to-all with computation
  and FP8 (GEMMs and cached activations, without which the model needs full recomputation) —
  so its throughput is a strict ``xfail`` of the band, and what is checked instead is the term
  that decides: its all-to-all against its compute, which DeepSeek-AI put at "approximately
  1:1", and that the published throughput lies between the model's estimate as it charges the
  run and the same estimate with the all-to-all hidden and no recomputation.
* MT-NLG 530B (DeepSpeed's pipeline engine with Megatron-LM's tensor slicing): the model is
  1.31–1.37 times its published throughput, a strict ``xfail`` of the band, where it is within
  10% of Megatron-LM's own runs of the same model and layout; what is checked instead is where
  the time goes: over the three cluster sizes (one global batch, fewer micro-batches per
  replica as the data-parallel size grows) the published step times grow with the micro-batches
  faster than the model's slots, and carry a fixed cost more than twice its bubble.
"""
from __future__ import annotations

import functools

import pytest

from labkit import cost_model
from labkit.memory_model import static_bytes_per_gpu
from labkit.reference import lab7 as published

GB = 10**9
RUNS = {run.name: run for run in published.published_runs()}
BAND = {"Megatron": 0.20, "BLOOM": 0.30, "Llama": 0.30, "DeepSeek": 0.30, "Korthikanti": 0.30, "MT-NLG": 0.30}
DEEPSEEK = "DeepSeek-V3 671B"
MTNLG_SLOWER = (
    "DeepSpeed's pipeline engine of 2021 ran slower than the Megatron-LM slots the model matches (Table "
    "1's 529.6B and Korthikanti's full-recompute 530B: the same model, T8·P35, full recomputation, within "
    "10%): MT-NLG's three step times fit 0.197 s per micro-batch plus 12.7 s, the model's 0.166 s plus "
    "5.9 s (its 1F1B bubble of 34 slots and the all-reduce) — 1.31 to 1.37 times the published throughput")
OFF_BAND = {  # runs whose published throughput rests on what the model leaves out
    DEEPSEEK: "the model charges the 64-way all-to-all across 8 nodes in full (DualPipe hides it) "
              "and needs full recomputation to fit its 16-bit activations (FP8 caching let the run "
              "skip it): 0.42 of the published throughput",
    **{f"MT-NLG 530B, {n:,} GPUs": MTNLG_SLOWER for n in (2240, 2800, 3360)},
}
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
    DEEPSEEK: "the cross-node all-to-all charged in full and full recomputation make E = 64 slower than "
              "E = 4 inside a node with T = 2",
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


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=OFF_BAND[n]))
                                  if n in OFF_BAND else n for n in RUNS])
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


def test_deepseek_v3_all_to_all_is_about_its_compute():
    """DeepSeek-AI 2024, §3.2.1: cross-node expert parallelism gives DeepSeek-V3 "an inefficient
    computation-to-communication ratio of approximately 1:1". The model's all-to-all over its
    compute for the run's layout must be at least that (it sends each token's k = 8 copies in
    16 bits, where the run sent at most 4 nodes' worth, half the calls in FP8: its bytes are at
    least theirs, its bf16 compute no faster than their FP8) and at most 1 / (4/7 · 3/4) = 2.33
    times it (the fewest bytes those two savings leave: 4 of the 7 copies that cross nodes, the
    average of 1 and 2 bytes over the four calls)."""
    e = scored(DEEPSEEK)
    ratio = e.time.comm["ep"] / e.time.compute
    assert 1 <= ratio <= 1 / (4 / 7 * 3 / 4), (
        f"DeepSeek-V3 as the model charges it ({e.config.label()}): all-to-all {e.time.comm['ep']:.3g} s "
        f"over compute {e.time.compute:.3g} s = {ratio:.2f}, against the published ~1:1")


def test_deepseek_v3_published_throughput_between_the_models_bounds():
    """The run's 1,543 tokens per second per GPU lie between the model's estimate as it charges
    the run (the all-to-all exposed, full recomputation) and the same layout with what the run
    is known to have done instead: the all-to-all hidden (DualPipe, §3.2.1) and no recomputation
    (FP8 activation caching, §3.3.3) — the step's compute, bubble and other traffic alone."""
    from dataclasses import replace

    run, e = RUNS[DEEPSEEK], scored(DEEPSEEK)
    tokens = run.global_batch * run.model.seq_len / run.cluster.n_gpus
    low = tokens / e.time.total
    hidden = cost_model.step_time(run.model, run.cluster, replace(e.config, checkpointing="none"), run.global_batch)
    high = tokens / (hidden.total - hidden.comm["ep"])
    assert low < run.notes["tokens_per_s"] < high, (
        f"DeepSeek-V3: the model's bounds {low:.0f} and {high:.0f} tokens/s per GPU, published "
        f"{run.notes['tokens_per_s']:.0f}")


def test_mtnlg_gap_is_per_micro_batch_and_fixed():
    """Smith et al. 2022, §2.4: 60.1, 50.2 and 44.4 s an iteration for 240, 192 and 160
    micro-batches per replica (one batch of 1,920 over D = 8, 10, 12). A straight line through
    them splits each step into seconds per micro-batch and a fixed part (the 1F1B bubble of P − 1
    slots, the all-reduce, the optimizer step); the same line through the model's step times
    locates the gap: its slots 10–30% faster than the run's, its fixed part less than half."""
    import numpy as np

    runs = [run for name, run in RUNS.items() if name.startswith("MT-NLG")]
    micro = np.array([run.global_batch // run.layout[0] for run in runs], dtype=float)
    slope_pub, fixed_pub = np.polyfit(micro, [run.notes["seconds"] for run in runs], 1)
    slope_mod, fixed_mod = np.polyfit(micro, [scored(run.name).time.total for run in runs], 1)
    assert 1.1 <= slope_pub / slope_mod <= 1.3 and fixed_pub > 2 * fixed_mod, (
        f"MT-NLG: published {slope_pub:.3f} s per micro-batch + {fixed_pub:.1f} s, the model "
        f"{slope_mod:.3f} s + {fixed_mod:.1f} s: the gap is no longer where the xfail reason says")
