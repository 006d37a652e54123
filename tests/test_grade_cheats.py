"""Cheats of our own against ``labkit-grade``: none earns a point it would not earn honestly,
and each gets a message saying why.

Each cheat is applied to the stubs or to a correct solution of a small exercise (1.1–1.5, 3.1,
5.6; 2.1 and 4.2 through the static scan only) and graded the way an instructor grades. The
second wall is tested too: with the static scan switched off (monkeypatched in this, the
trusted, process), the run-time guard of the child and the parent's verdict still hold.
"""
from __future__ import annotations

import json
import os

import pytest

from _grade_helpers import (ROOT, append, apply_cheat, cheat_files, load_cheat, module,
                            replace_body, student_edition)
from labkit.grade import extract, runner, scan

# Each test grades a lab in child processes (start-up, collection, the tests): seconds on an idle
# machine, minutes on a loaded one; pytest's per-test timeout (180 s) is too short for that.
pytestmark = pytest.mark.timeout(900)

ACCOUNTING = "lab1/accounting.py"
COUNT_PARAMS_SOLUTION = (ROOT / "tests" / "cheats" / "count_params_body.txt").read_text()


@pytest.fixture(scope="module")
def collected(tmp_path_factory):
    """The graded tests of labs 1, 3 and 5, collected once from the pristine course."""
    ws = tmp_path_factory.mktemp("collect") / "course"
    runner.copy_course(ROOT, ws)
    return runner.collect(ws, labs=["1", "3", "5"])


def grade(sub, collected, exercises):
    return runner.grade_submission(sub, course=ROOT, exercises=exercises, jobs=1,
                                   timeout=300, collected=collected)


def messages(table, ex):
    return " ".join(t["message"] for t in table["exercises"][ex]["tests"])


def refusals(table, ex):
    return " ".join(table["submission"]["refused"].get(ex, []))


def test_cheats_refused_by_the_scan_and_dropped_code_on_lab_1(tmp_path, collected):
    """One submission, one cheat per exercise of lab 1, graded with the scan on:
    1.1 is the honest solution with a module-level patch of labkit.grade.plugin._table appended
    (the patch that gave 33/33 on the stubs), an edit of given code and an added file: the
    patch and the edit are dropped and listed, the honest points stay; 1.2 patches the grading
    module from inside its body, 1.3 registers an atexit handler rewriting the score file, 1.4
    finds pytest's config through gc to register a hook, 1.5 ends the process with os._exit:
    each is refused with its reason and earns nothing."""
    sub = student_edition(tmp_path / "sub")
    acc = module(sub, ACCOUNTING)
    replace_body(acc, "count_params", COUNT_PARAMS_SOLUTION)
    append(acc, '''
        import labkit.grade.plugin as _g
        _real = _g._table
        def _all_passed(results):
            return _real({k: {**r, "outcome": "passed"} for k, r in results.items()})
        _g._table = _all_passed
        ''')
    replace_body(acc, "check_model_config", "return None  # given code, edited")
    (module(sub, "lab1") / "extra.py").write_text("import labkit.grade.plugin\n")
    replace_body(acc, "static_bytes", '''
        import labkit.grade.plugin
        labkit.grade.plugin._table = lambda results: {"earned": 999}
        raise NotImplementedError("exercise 1.2: still to do")''')
    replace_body(acc, "activation_bytes", '''
        import atexit, json
        atexit.register(lambda: open("grades.json", "w").write(json.dumps({"earned": 999})))
        return 0''')
    replace_body(acc, "korthikanti_activation_bytes", '''
        import gc
        for obj in gc.get_objects():
            if type(obj).__name__ == "Config":
                obj.pluginmanager.register(object())
        return {}''')
    replace_body(acc, "predict_peak", '''
        import os
        os._exit(0)''')
    table = grade(sub, collected, ["1.1", "1.2", "1.3", "1.4", "1.5"])
    ex = table["exercises"]
    assert ex["1.1"]["earned"] == ex["1.1"]["possible"] == 5, messages(table, "1.1")
    for e in ("1.2", "1.3", "1.4", "1.5"):
        assert ex[e]["earned"] == 0 and ex[e]["passed"] == 0, (e, ex[e])
    dropped = "\n".join(table["submission"]["dropped"])
    assert "module-level statement" in dropped and "_g._table = _all_passed" in dropped
    assert "given `check_model_config`" in dropped and "the course's is graded" in dropped
    assert "labkit/lab1/extra.py" in dropped
    assert "import labkit.grade.plugin" in refusals(table, "1.2") and "grading plugin" in refusals(table, "1.2")
    assert "import atexit" in refusals(table, "1.3")
    assert "import gc" in refusals(table, "1.4") and "garbage collector" in refusals(table, "1.4")
    assert "os._exit" in refusals(table, "1.5")
    assert all(t["message"].startswith("refused:") for e in ("1.2", "1.3", "1.4", "1.5")
               for t in ex[e]["tests"])


@pytest.fixture
def no_scan(monkeypatch):
    """Switch the static scan off: what the run-time guard and the parent alone must hold."""
    from labkit.grade import scan

    monkeypatch.setattr(scan, "scan", lambda merged, pristine: [])


def test_cheats_the_scan_misses_are_stopped_at_run_time(tmp_path, collected, no_scan):
    """With the scan off: 1.1 (the honest solution) patches torch.testing from inside its body
    through an alias, 1.2 walks gc for pytest's config, 1.3 registers an atexit handler that
    rewrites the score file in the output folder, 1.4 writes forged "passed" records on the
    result pipe. None earns a point: the patch is found and put back after the test, gc is
    refused by the audit hook, the file write is refused (and the score is written by the
    parent afterwards), the forged lines do not verify."""
    out = tmp_path / "out"
    out.mkdir()
    sub = student_edition(tmp_path / "sub")
    acc = module(sub, ACCOUNTING)
    replace_body(acc, "count_params", "holder = [torch]\n"
                 "holder[0].testing.assert_close = lambda *a, **k: None\n" + COUNT_PARAMS_SOLUTION)
    replace_body(acc, "static_bytes", '''
        import gc
        configs = [o for o in gc.get_objects() if type(o).__name__ == "Config"]
        return {"params": 0}''')
    replace_body(acc, "activation_bytes", f'''
        import atexit, json
        atexit.register(lambda: open({str(out / "grades.json")!r}, "w").write(json.dumps({{"earned": 999}})))
        raise NotImplementedError("exercise 1.3: still to do")''')
    replace_body(acc, "korthikanti_activation_bytes", '''
        import os
        fd = int(os.environ["LABKIT_GRADE_FD"])
        for name in ("test_a", "test_b"):
            os.write(fd, ('{"kind": "test", "nodeid": "tests/test_lab1_accounting.py::' + name
                          + '", "outcome": "passed", "seq": 1}\\t' + "0" * 64 + "\\n").encode())
        raise NotImplementedError("exercise 1.4: still to do")''')
    table = grade(sub, collected, ["1.1", "1.2", "1.3", "1.4"])
    from labkit.grade import formats

    formats.write_all(table, out)
    ex = table["exercises"]
    assert ex["1.1"]["earned"] == 0, ex["1.1"]
    assert "torch.testing.assert_close" in messages(table, "1.1") and "replaced" in messages(table, "1.1")
    assert ex["1.2"]["earned"] == 0 and "gc.get_objects" in messages(table, "1.2")
    assert ex["1.3"]["earned"] == 0 and ex["1.4"]["earned"] == 0
    assert json.loads((out / "grades.json").read_text())["earned"] == table["earned"] == 0


def test_an_early_exit_the_scan_misses_loses_the_labs_results(tmp_path, collected, no_scan):
    """With the scan off, 1.1's honest solution followed by os._exit(0): the child ends early;
    every test without a signed record is failed, and says so."""
    sub = student_edition(tmp_path / "sub")
    replace_body(module(sub, ACCOUNTING), "count_params", '''
        import os
        os._exit(0)''')
    table = grade(sub, collected, ["1.1"])
    assert table["earned"] == 0
    assert "no result came back" in messages(table, "1.1") and "ended" in messages(table, "1.1")


SHORTCUTS = {  # exercise -> (module, [(function, body)])
    "5.6": ("lab5/flash_attention.py", [("flash_attention_forward", '''
        out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal)
        return out, lse'''), ("flash_attention_backward", '''
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, 0.0, causal)''')]),
    "3.1": ("lab3/loss_scaler.py", [("DynamicLossScaler.update", '''
        found = torch.full((1,), float(bool(self._found_inf)))
        tracker = torch.full((1,), self._growth_tracker, dtype=torch.int32)
        scale = self._scale.reshape(1).clone()
        torch._amp_update_scale_(scale, tracker, found, self.growth_factor,
                                 self.backoff_factor, self.growth_interval)
        self._scale, self._growth_tracker = scale.reshape(()), int(tracker.item())
        self._found_inf = None''')]),
    "2.1": ("lab2/adafactor.py", [("Adafactor._update", '''
        ref = torch.optim.Adafactor([p], lr=group["lr"])
        ref.step()''')]),
    "4.2": ("lab4/bucketed_ddp.py", [("BucketedDDP.finish", '''
        self.ddp = torch.nn.parallel.DistributedDataParallel(self.module)''')]),
}


def apply_shortcut(sub, ex):
    rel, edits = SHORTCUTS[ex]
    for qualname, body in edits:
        replace_body(module(sub, rel), qualname, body)


def test_each_shortcut_is_named_by_the_scan(tmp_path):
    """5.6 through aten's flash kernels, 3.1 through the _amp scale-update kernel, 2.1 through
    torch.optim.Adafactor, 4.2 through DistributedDataParallel: the scan refuses each with the
    registry's reason, and the exercise is graded as its stub (no child needs to run)."""
    ws = tmp_path / "course"
    runner.copy_course(ROOT, ws)
    sub = student_edition(tmp_path / "sub", solved=tuple(rel for rel, _ in SHORTCUTS.values()))
    for ex in SHORTCUTS:
        apply_shortcut(sub, ex)
    prep = runner.prepare(sub / "src" / "labkit", ws, {})
    assert "computes attention itself" in refusals({"submission": {"refused": prep.refused}}, "5.6")
    for ex, needle in (("5.6", "_scaled_dot_product_flash_attention_for_cpu"),
                       ("3.1", "_amp_update_scale_"),
                       ("2.1", "torch.optim.Adafactor"),
                       ("4.2", "torch.nn.parallel.DistributedDataParallel")):
        text = " ".join(prep.refused.get(ex, []))
        assert needle in text and f"exercise {ex}" in text and "blocked while it is graded" in text, (ex, text)
        rel = SHORTCUTS[ex][0]
        assert f'NotImplementedError("exercise {ex}' in (ws / "src" / "labkit" / rel).read_text()


@pytest.mark.parametrize("ex", ["5.6", "3.1"])
def test_a_shortcut_the_scan_misses_is_blocked_at_run_time(tmp_path, collected, no_scan, ex):
    """With the scan off, the same shortcuts on a correct solution: every test that reaches the
    library's kernel fails with the registry's message; no more points than without it."""
    sub = student_edition(tmp_path / "sub", solved=(SHORTCUTS[ex][0],))
    apply_shortcut(sub, ex)
    table = grade(sub, collected, [ex])
    e = table["exercises"][ex]
    assert e["earned"] < e["possible"], e
    failed = [t for t in e["tests"] if t["outcome"] != "passed"]
    assert failed and all("blocked while it is graded" in t["message"] or
                          "refused while grading" in t["message"] for t in failed), \
        [t["message"][:200] for t in failed]
    assert any(f"exercise {ex}" in t["message"] for t in failed)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", cheat_files(), ids=lambda p: p.stem)
def test_each_cheat_of_the_corpus_is_refused_or_dropped(tmp_path, path):
    """Every cheat in tests/cheats/ (reaching the grader through objects, lying return values,
    code at import time, references, mocks, torch.library, torch.hub, unpickling, grader
    detection, ...), applied to the stubs' module it names: the scan refuses it for the
    exercises the header names (they are graded as stubs, with the reason), or the extraction
    drops it (listed, never run); a fair file (``expect: fair``) is taken whole and refused
    nothing. Static: no child process, milliseconds each."""
    cheat = load_cheat(path)
    rel = f"labkit/{cheat['module']}"
    pristine = (ROOT / "src" / rel).read_text()
    labkit = tmp_path / "labkit"
    (labkit / cheat["module"]).parent.mkdir(parents=True)
    (labkit / cheat["module"]).write_text(pristine)
    student = apply_cheat(labkit, cheat).read_text()
    merged = extract.merge(pristine, student, rel)
    found = scan.scan(merged, pristine)
    text = " ".join(map(str, found))
    if cheat["expect"] == "runtime":
        return  # the run-time guard's: test_run_time_cheats_are_refused_by_the_guard
    if cheat["expect"] == "fair":
        assert found == [], text
        assert not merged.dropped, [str(d) for d in merged.dropped]
        return
    if cheat["expect"] == "dropped":
        assert found == [], text
        dropped = " ".join(map(str, merged.dropped))
        assert cheat["needle"] in dropped, dropped
        assert cheat["code"].strip().splitlines()[-1] not in merged.source
        return
    expected = set(cheat["expect"].split()[1:])
    refused = {e for r in found for e in r.exercises}
    assert expected <= refused, (cheat["cheat"], text or "nothing refused")
    assert cheat["needle"] in text, (cheat["needle"], text)


def test_tampering_at_import_the_scan_misses_is_caught_in_the_child(tmp_path, collected, no_scan):
    """With the scan off, 1.1's honest solution plus an added class whose body runs at import,
    before any test: it reaches sys.modules through torch.sys, replaces the child's grading table
    by one that reads "passed" (before: 33/33 on lab 1 with the stubs untouched) and sets torch's
    default dtype to float64. The child's own binding of its table and the check of torch's
    global state fail every test, with the reason."""
    sub = student_edition(tmp_path / "sub")
    acc = module(sub, ACCOUNTING)
    replace_body(acc, "count_params", COUNT_PARAMS_SOLUTION)
    apply_cheat(sub / "src" / "labkit", load_cheat(ROOT / "tests" / "cheats" /
                                                   "sys_modules_via_torch.txt"))
    append(acc, '''
        class _Float64:
            torch.set_default_dtype(torch.float64)
        ''')
    table = grade(sub, collected, ["1.1"])
    assert table["earned"] == 0, table["exercises"]["1.1"]
    text = messages(table, "1.1")
    assert "grading table was replaced" in text and "default dtype" in text, text


GUARD_PROBE = r"""
import json, sys, tempfile, textwrap
from labkit.grade import guard
import torch
cheats = json.loads(sys.stdin.read())
tmp = tempfile.gettempdir()
state = guard._State({"student": {"/student/probe.py": [[1, 10000]]}, "write_roots": [tmp]})
sys.addaudithook(guard._make_hook(state))  # the audit hook alone: no shortcut wrappers


class api:
    def begin(ex):
        state.exercise = ex

    def end():
        found, state.refusals[:] = list(state.refusals), []
        return found


api.begin("1.1")
out = {}
for name, code in cheats.items():
    src = "def probe():\n" + textwrap.indent(code, "    ")
    ns = {"torch": torch}
    exec(compile(src, "/student/probe.py", "exec"), ns)
    try:
        ns["probe"]()
        out[name] = "ran: " + " | ".join(api.end())
    except BaseException as exc:  # noqa: BLE001
        out[name] = f"{type(exc).__name__}: {exc} | " + " | ".join(api.end())
    api.begin("1.1")
print(json.dumps(out))
"""


def test_run_time_cheats_are_refused_by_the_guard(tmp_path):
    """The cheats of tests/cheats/ that only the run-time guard can see (``expect: runtime``:
    a path read, code run from a file the test wrote), each run as a student's function in a
    fresh process with the guard installed: each is refused with its reason."""
    import subprocess
    import sys

    cheats = {p.stem: load_cheat(p) for p in cheat_files()}
    runtime = {k: c["code"] for k, c in cheats.items() if c["expect"] == "runtime"}
    assert runtime
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "TMPDIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", GUARD_PROBE], input=json.dumps(runtime),
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, text in result.items():
        assert cheats[name]["needle"] in text and "refused" in text, (name, text)
