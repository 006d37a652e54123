# GPU-path checks for "Where the Memory Goes" (~7-9 min on one GPU: Colab after the labs' set-up
# cell, or any box with torch >= 2.7 + CUDA). Run from the repository root: bash gpu_check.sh
# Output and logs: $OUT (or ./_gpu_check). Changes nothing in the repository.
# The repository's copy of ../shared/gpu_check.sh, for the labkit/labN/ layout (exercise modules
# in labkit.labN, per-rank harnesses in labkit.harness.labN, one grader file per module).
# Run from the project's root: bash tools/gpu_check.sh
set -u
export OUT=${OUT:-$PWD/_gpu_check}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 LABKIT_SOLUTIONS=$PWD/solutions
PT="python3 -m pytest -q -rs -p no:cacheprovider"
nvidia-smi --query-gpu=name,compute_cap,memory.total,driver_version --format=csv,noheader
python3 -c "import sys,os,torch;print(sys.version.split()[0],torch.__version__,torch.version.cuda,torch.cuda.get_device_capability(),os.cpu_count(),'CPUs')"
# which of labkit.torch_compat's shims this torch needs (an older torch, as Colab's may be)
python3 -c "import labkit, torch.distributed as d; from labkit.torch_compat import has_op_output as h; print('labkit needs torch >=', labkit.MIN_TORCH, '| SAC ctx.op_output:', h(), '| dist.all_gather_single:', hasattr(d, 'all_gather_single'))"

# 0. what depends on the torch release (on this torch, maybe older than the course's): the shims,
#    lab 5's selective checkpointing (ctx.op_output), 3.2's fused step, lab 4's collectives
$PT tests/test_torch_compat.py tests/test_lab5_selective_checkpoint.py tests/test_lab3_mixed_precision.py \
    tests/test_lab4_compression.py -k "not training" 2>&1 | tee "$OUT/torch_release.log" | tail -3
# 1. the CUDA-only tests, in a fresh process (5.5's two are graded, test_measure's and 2.6's are not)
$PT tests/test_measure.py tests/test_lab2_zero_offload.py tests/test_lab5_offload.py \
    -k "cuda or memory_history or offload_frees" 2>&1 | tee "$OUT/cuda_only.log" | tail -3
# 2. 6.1's real-allocator test alone, then after other CUDA tests in the same process (--grade order)
$PT "tests/test_lab6_caching_allocator.py::test_simulator_matches_the_real_cuda_allocator" 2>&1 | tail -2
$PT -m exercise --grade --grade-json "$OUT/grade.json" tests/test_lab5_offload.py tests/test_lab6_caching_allocator.py \
    -k "cuda or offload_frees or simulator_matches" 2>&1 | grep -E "^5\.5|^6\.1|FAIL|hold CUDA" | head -6
# 3. lab_batch_size(42) on a CUDA build of torch (torch.device(42) is cuda:42 there)
$PT tests/test_models.py -k refuse 2>&1 | tail -2
# 4. multi-rank graders after a CUDA test in one process (make test-gpu's order): launch spawns
timeout 300 $PT tests/test_lab2_zero_offload.py::test_zero_offload_lowers_the_device_peak_on_cuda \
    tests/test_lab2_zero1.py --durations=3 2>&1 | tail -6

# 5. the lab cells only a GPU runs (a file, not stdin: spawned ranks re-import the main module)
cat > "$OUT/cells.py" <<'PY'
import copy, math, os, resource, time, torch
from labkit.ranks import launch, start_method_for
from labkit.models import GPT, SyntheticData, lab_batch_size, lab_config
DEV = os.environ.get("DEV", "cuda")
def attempt(name, f):
    t0 = time.perf_counter()
    try: print(f"{name}: {f() or 'ok'} [{time.perf_counter() - t0:.1f} s]", flush=True)
    except Exception as e: print(f"{name}: FAILS {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
def children():
    r = resource.getrusage(resource.RUSAGE_CHILDREN); return r.ru_utime + r.ru_stime, r.ru_maxrss / 2**20
def main():
    # lab 3 cell 25: the reference Fp8Linear on the GPU (forward, then backward), and the column-major fix;
    # below sm 8.9 (T4, A100) torch._scaled_mm has no fp8 kernel and the lab runs these on CPU copies
    from labkit.lab3.fp8 import Fp8Linear
    fp8 = DEV if DEV == "cpu" or torch.cuda.get_device_capability() >= (8, 9) else "cpu"
    print(f"fp8 cells on {fp8}" + ("" if fp8 == DEV else f" (sm {torch.cuda.get_device_capability()} < 8.9, as the lab does)"))
    lin, x, y = Fp8Linear(512, 2048).to(fp8), torch.randn(4096, 512, device=fp8, requires_grad=True), []
    attempt("fp8 forward", lambda: y.append(lin(x)))
    attempt("fp8 backward", lambda: y[0].backward(torch.randn_like(y[0])))
    one = torch.ones((), device=fp8)
    qg = torch.randn(4096, 2048, device=fp8).to(torch.float8_e5m2)
    qx = torch.randn(4096, 512, device=fp8).to(torch.float8_e4m3fn)
    attempt("fp8 grad_w with mat2 column-major (the fix)", lambda: [torch._scaled_mm(
        qg.t().contiguous(), qx.t().contiguous().t(), scale_a=one, scale_b=one, out_dtype=torch.float32)] and None)
    # lab 2 cell 21: v on the GPU, the code on the CPU: the reference, then the lab text's recipe
    from labkit.lab2.quantize8bit import dequantize_blockwise, linear_code, quantize_blockwise
    v, code = torch.rand(2048 * 512, device=DEV) ** 4, linear_code(signed=False)
    attempt("quantize reference (v on GPU, code on CPU)",
            lambda: [dequantize_blockwise(*quantize_blockwise(v, code, 256), code, 256)] and None)
    attempt("student recipe bucketize(v, midpoints)", lambda: [torch.bucketize(v, (code[1:] + code[:-1]) / 2)] and None)
    attempt("student recipe code[codes]", lambda: [code[torch.zeros(8, dtype=torch.long, device=DEV)]] and None)
    cfg = lab_config("cuda")
    data = SyntheticData(cfg.vocab_size, cfg.block_size, lab_batch_size("cuda"), device=DEV)
    # lab 3 cells 8 and 16: fp16 autocast with your loss scaler; MixedPrecisionAdam's fused step on
    # bf16 GPU parameters (its step counts must be on the GPU: a CPU one is an illegal memory access)
    from labkit.lab3.loss_scaler import DynamicLossScaler
    from labkit.lab3.mixed_precision import MixedPrecisionAdam
    def amp_steps():
        torch.manual_seed(0)
        m = GPT(cfg).to(DEV)
        opt, scaler, skipped = torch.optim.Adam(m.parameters()), DynamicLossScaler(init_scale=2.0 ** 16, growth_interval=10), 0
        for i in range(6):
            with torch.autocast(torch.device(DEV).type, dtype=torch.float16):
                loss = m(*data.batch(i))
            scaler.scale(loss).backward()
            skipped += not scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
        return f"{skipped} of 6 steps skipped, scale 2^{math.log2(scaler.get_scale()):.0f}, loss {loss.item():.3f}"
    def master_steps():
        torch.manual_seed(0)
        m = GPT(cfg).to(DEV, torch.bfloat16)
        opt = MixedPrecisionAdam(m.parameters(), lr=1e-3)
        for i in range(3):
            m(*data.batch(i)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return f"loss after 3 steps {m(*data.batch(3)).item():.3f}"
    attempt("fp16 autocast + DynamicLossScaler (lab 3 cell 8)", amp_steps)
    attempt("MixedPrecisionAdam on bf16 GPU parameters (lab 3 cell 16)", master_steps)
    # lab 5 cell 47: activation offloading on the GPU (side stream, pinned host copies)
    from labkit.lab5.offload import ActivationOffloader
    def offload_cell():
        torch.manual_seed(0)
        m, off = GPT(cfg).to(DEV), ActivationOffloader(min_bytes=1024)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        with off:
            loss = m(*data.batch(0))
        held = torch.cuda.memory_allocated() - base
        loss.backward()
        torch.cuda.synchronize()
        return f"{off.host_bytes / 2**20:.0f} MiB to the host, {held / 2**20:.1f} MiB held on the GPU after forward"
    attempt("ActivationOffloader forward + backward (lab 5 cell 47)", offload_cell)
    # lab 6 cells 47 and 49: torch.compile on the GPU (Triton), fused Adam's step
    from labkit.lab6.fusion import gelu_tanh_unfused
    xg = torch.randn(256, 1024, device=DEV, requires_grad=True)
    attempt("torch.compile(gelu chain) forward + backward (lab 6 cell 47)",
            lambda: torch.compile(gelu_tanh_unfused)(xg).sum().backward())
    def fused_adam():
        m = GPT(cfg).to(DEV)
        opt = torch.optim.Adam(m.parameters(), fused=True)
        m(*data.batch(0)).backward()
        opt.step()
    attempt("Adam(fused=True) step (lab 6 cell 49)", fused_adam)
    # lab 1 cell 56: snapshot cost; max_memory_allocated vs MemTracker, alone and beside 512 MiB of others
    from labkit.measure import measure_step
    def step(snapshot=None):
        torch.manual_seed(0)
        m = GPT(cfg).to(DEV)
        s = measure_step(m, torch.optim.Adam(m.parameters(), foreach=False), data.batch(0), steps=2,
                         snapshot_path=snapshot)
        cmax = s.cuda_max_allocated or 0
        return f"MemTracker peak {s.peak:,} B, max_memory_allocated {cmax:,} B ({cmax / s.peak - 1:+.2%})"
    snap = os.path.join(os.environ["OUT"], "lab1_snapshot.pickle")
    attempt("measure_step + snapshot", lambda: step(snap) + (
        f", snapshot {os.path.getsize(snap) / 2**20:.0f} MiB" if os.path.exists(snap) else ", no snapshot"))
    other = torch.empty(2**29, dtype=torch.uint8, device=DEV)  # an earlier cell's model, say
    attempt("measure_step beside 512 MiB of other tensors", step)
    del other
    # CUDA is initialised now, so the labs' gloo ranks come from the forkserver: lab 5 (N = 8), lab 3's ZeRO-3 cell
    from labkit.harness.lab5 import ring_worker
    from labkit.harness.lab3 import train_zero3
    print("start method now:", start_method_for(), flush=True)
    q, k, vv = (torch.randn(1, 4, 512, 32) for _ in range(3))
    c0 = children()[0]
    attempt("ring N=8 zigzag (lab timeout 120 s)", lambda: launch(
        ring_worker, 8, q, k, vv, True, layout="zigzag", timeout=300) and f"{children()[0] - c0:.0f} CPU-s in ranks")
    torch.manual_seed(0)
    ccfg = lab_config("cpu")
    base, d = GPT(ccfg), SyntheticData(ccfg.vocab_size, ccfg.block_size, lab_batch_size("cpu"))
    b = [[d.batch(s * 4 + r) for r in range(4)] for s in range(2)]
    c0 = children()[0]
    attempt("zero3 N=4 at the CPU sizes the lab now uses (lab timeout 120 s)", lambda: launch(
        train_zero3, 4, copy.deepcopy(base), b, timeout=300) and
        f"{children()[0] - c0:.0f} CPU-s in ranks, largest rank {children()[1]:.1f} GiB RSS")
if __name__ == "__main__":
    main()
PY
timeout 420 python3 "$OUT/cells.py" 2>&1 | tee "$OUT/cells.log"

# 6. what a Colab student sees for the two exercises that have CUDA graders
python3 -c "import labkit; labkit.check('5.5'); labkit.check('6.1')" 2>&1 | tail -8
