"""The README's two-node command, run: two ``torchrun`` agents on 127.0.0.1 sharing one c10d
rendezvous are two "nodes" of one job.

    torchrun --nnodes 2 --nproc-per-node K --rdzv-backend c10d --rdzv-endpoint NODE0:PORT \\
        --rdzv-id ID -m labkit.cluster zero1 ...

Each agent starts its own ranks; the rendezvous numbers them across the nodes and hands them
one process group (gloo here). What a real cluster adds (a network between the machines, NCCL,
GPUs) is not tested here; what is: the rendezvous of two agents, ranks numbered across nodes,
the demo's figures equal to a one-node job's, and a rank that dies on one node brought to the
other node's terminal as an error, never a hang (``--timeout`` bounds each collective, the
test's own deadline the whole job, and both agents' process groups are killed past it).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from labkit.ranks import reserved_port

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
DEADLINE = 150  # seconds for one two-node job, rendezvous included; past it both agents are killed
# zero1 at tiny sizes: a 2-layer GPT of 28,032 parameters, 2 steps (a few seconds per rank)
DEMO = ["zero1", "--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--vocab-size", "64",
        "--seq", "16", "--batch", "2", "--steps", "2", "--device", "cpu", "--timeout", "30"]
# figures that do not depend on timing: bytes, calls and the model's size
EXACT = ("psi", "state_bytes", "predicted_state_bytes", "bytes_sent_per_step", "calls")

pytestmark = pytest.mark.skipif(TORCHRUN is None, reason="torchrun is not installed next to this Python")


def _env(solutions: bool) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("LABKIT_SOLUTIONS", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    if solutions and os.environ.get("LABKIT_SOLUTIONS"):
        env["LABKIT_SOLUTIONS"] = os.environ["LABKIT_SOLUTIONS"]
    return {**env, "OMP_NUM_THREADS": "1"}


def _finish(procs: list[subprocess.Popen], started: float) -> list[tuple[int, str]]:
    """(exit status, output) of each agent; past DEADLINE both are killed with their ranks."""
    results = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1.0, DEADLINE - (time.monotonic() - started)))
        except subprocess.TimeoutExpired:
            for q in procs:  # each agent leads its own session: its ranks go with it
                try:
                    os.killpg(q.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            outputs = [q.communicate()[0][-3000:] for q in procs]
            pytest.fail(f"the two-node job did not end in {DEADLINE} s (a hang):\n" + "\n---\n".join(outputs))
        results.append((p.returncode, out))
    return results


def two_nodes(solutions=(True, True)) -> list[tuple[int, str]]:
    """Run DEMO as two nodes of one process each: node 0 hosts the rendezvous's store."""
    with reserved_port() as port:  # held until both agents are done
        started = time.monotonic()
        return _finish(_start(port, solutions), started)


def _start(port: int, solutions) -> list[subprocess.Popen]:
    procs = []
    for node, with_solutions in enumerate(solutions):
        cmd = [TORCHRUN, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"two-nodes-{port}",
               # is_host: which agent serves the store (both addresses are this machine's);
               # join_timeout: a node whose peer never comes gives up instead of waiting
               "--rdzv-conf", f"is_host={int(node == 0)},join_timeout=60",
               "--local-addr", "127.0.0.1", "--max-restarts", "0", "-m", "labkit.cluster", *DEMO]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=_env(with_solutions), text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      start_new_session=True))
    return procs


def _printed(outputs: list[str]) -> dict:
    """The demo's ``json:`` line, printed by rank 0, on whichever node rank 0 landed."""
    lines = [ln for out in outputs for ln in out.splitlines() if ln.startswith("json: ")]
    assert len(lines) == 1, "expected one json line (rank 0's):\n" + "\n---\n".join(o[-3000:] for o in outputs)
    return json.loads(lines[0][len("json: "):])


@pytest.mark.timeout(2 * DEADLINE + 30)
def test_two_nodes_compute_what_one_node_with_two_processes_computes():
    """zero1 as two one-process nodes and as one two-process node: the same bytes, calls and loss."""
    nodes = two_nodes()
    for node, (status, out) in enumerate(nodes):
        assert status == 0, f"node {node} exited with {status}:\n{out[-4000:]}"
    spread = _printed([out for _, out in nodes])
    one = subprocess.run([TORCHRUN, "--standalone", "--nproc-per-node", "2", "-m", "labkit.cluster", *DEMO],
                         cwd=ROOT, env=_env(True), capture_output=True, text=True, timeout=DEADLINE)
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    single = _printed([one.stdout])
    assert spread["world_size"] == 2 and [r["rank"] for r in spread["ranks"]] == [0, 1], spread
    for got, want in zip(spread["ranks"], single["ranks"]):
        for key in EXACT:
            assert got[key] == want[key], f"rank {got['rank']} {key}: two nodes {got[key]}, one node {want[key]}"
        # the same data, the same sums in the same order over gloo: the loss agrees to float
        # rounding (a different reduction order would still be within 1e-5 relative)
        assert got["final_loss"] == pytest.approx(want["final_loss"], rel=1e-5), (got, want)


@pytest.mark.timeout(DEADLINE + 30)
@pytest.mark.skipif(not os.environ.get("LABKIT_SOLUTIONS"),
                    reason="needs LABKIT_SOLUTIONS: node 0 runs the reference ZeRO-1, node 1 the stubs")
def test_a_rank_that_dies_on_one_node_is_reported_by_the_other():
    """Node 1 runs the student stubs: its rank raises NotImplementedError in ZeRO-1's step and
    exits. Node 0's rank, waiting in the reduce-scatter, must fail with gloo's lost-peer error
    (not wait for ever), and both agents must exit non-zero, each with its rank's traceback."""
    (status0, out0), (status1, out1) = two_nodes(solutions=(True, False))
    assert status1 != 0 and "NotImplementedError: exercise 2.5" in out1, out1[-4000:]
    assert status0 != 0, f"node 0 exited with {status0} although its peer died:\n{out0[-4000:]}"
    assert "Connection closed by peer" in out0 or "Connection reset by peer" in out0, (
        f"node 0 does not report the lost peer:\n{out0[-4000:]}")
    for out in (out0, out1):  # torchrun's summary names the job and the failed rank
        assert "labkit.cluster FAILED" in out and "Traceback" in out, out[-3000:]
