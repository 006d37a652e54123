"""Cheats of our own against ``labkit-grade``: each is zeroed or flagged, or earns nothing at run time.

The corpus, tests/cheats/, is read statically first (milliseconds each): each cheat gets the red
flags its header names, or is dropped by extraction; each honest variant gets full credit and no
flag. The cheats that the reading cannot stop (computed names, other threads, other processes,
the result pipe, shared state) are then graded the way an instructor grades, in the child behind
the operating system's wall: none earns a point it would not earn honestly without a flag or a
refusal that says why. The wall itself (writes, network, processes that outlive a test) is
tested in test_grade_isolation.py.
"""
from __future__ import annotations

import ast
import fcntl
import json
import os
from pathlib import Path

import pytest

from _grade_helpers import (CHEATS, ROOT, apply_cheat, cheat_files, load_cheat, module,
                            replace_body, student_edition)
from labkit.grade import extract, flags, runner

# Each test below grades a lab in a child process (start-up, collection, the tests): seconds on an
# idle machine, minutes on a loaded one; pytest's per-test timeout (180 s) is too short for that.
pytestmark = pytest.mark.timeout(900)

COUNT_PARAMS = (CHEATS / "count_params_body.txt").read_text()
RUN_TESTS = (ROOT / "tests" / "test_grade_cheats.py").read_text() + \
    (ROOT / "tests" / "test_grade_isolation.py").read_text()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", cheat_files(), ids=lambda p: p.stem)
def test_each_cheat_of_the_corpus_is_zeroed_flagged_or_dropped(tmp_path, path):
    """Every file of tests/cheats/, applied to the stubs' module it names: ``zero``: a flag that
    zeroes the exercises named (they are graded as stubs); ``flag``: a flag for review on them
    (the instructor sees it; some are also stopped at run time below); ``run``: nothing to read,
    stopped at run time by a test here that names the file; ``dropped``: left out by
    extraction (its ``absent`` text, else its last line, is not in the module); ``fair``: taken
    whole, no flag."""
    cheat = load_cheat(path)
    rel = f"labkit/{cheat['module']}"
    pristine = (ROOT / "src" / rel).read_text()
    (tmp_path / cheat["module"]).parent.mkdir(parents=True)
    (tmp_path / cheat["module"]).write_text(pristine)
    merged = extract.merge(pristine, apply_cheat(tmp_path, cheat).read_text(), rel)
    found = flags.read(merged, pristine)
    kind, *exercises = cheat["expect"].split()
    text = {ex: " | ".join(map(str, fs)) for ex, fs in found.items()}
    if kind in ("fair", "dropped", "run"):
        assert not any(f.zeroes for fs in found.values() for f in fs), text
    if kind == "fair":
        assert not any(found.values()) and not merged.dropped, (text, merged.dropped)
        placed = extract.units(ast.parse(merged.source))  # each unit as it was read, no line less
        assert all(ast.dump(placed[u].node) == ast.dump(node) for u, node, _ in merged.taken
                   if u in merged.units), path.stem
    elif kind == "dropped":
        assert cheat["needle"] in " ".join(map(str, merged.dropped)), merged.dropped
        assert cheat.get("absent", cheat["code"].strip().splitlines()[-1]) not in merged.source
    elif kind in ("zero", "flag"):
        for ex in exercises:
            hits = [f for f in found.get(ex, []) if f.name == cheat["needle"]]
            assert hits and all(f.zeroes is (kind == "zero") for f in hits), (ex, text)
            assert kind == "zero" or "fair" not in cheat or not any(  # honest work flagged for
                f.zeroes for f in found.get(ex, [])), (ex, text)  # review: nothing else zeroes it
    if kind == "run":
        assert path.stem in RUN_TESTS, f"{path.stem}: no test grades it at run time"


@pytest.fixture(scope="module")
def collected(tmp_path_factory):
    """The graded tests of labs 1, 2, 3, 5 and 6, collected once from the pristine course: once
    for all of make test's pytest-xdist workers (a collection is a child, ~10 CPU-s), the first
    that needs it writing it, under a lock, where the others read it (the session's own folder)."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # (the session's)
    path = shared / "collected-labs-1-2-3-5-6.json"
    with open(f"{path}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # (released when the file closes)
        if not path.exists():
            ws = tmp_path_factory.mktemp("collect") / "course"
            runner.copy_course(ROOT, ws)
            path.write_text(json.dumps(runner.collect(ws, labs=["1", "2", "3", "5", "6"])))
        return json.loads(path.read_text())


@pytest.fixture
def unread(monkeypatch):
    """The grader without its reading (``flags.read`` finds nothing): for the tests of what is
    behind it, the child's refusals and records and the parent's rules, with cheats the reading
    zeroes (they must hold where a reading misses)."""
    monkeypatch.setattr(flags, "read", lambda merged, pristine: {})


def grade(sub, collected, exercises):
    return runner.grade_submission(sub, course=ROOT, exercises=exercises, jobs=1, timeout=600,
                                   collected=collected)


def submission(tmp_path, *cheats, solved=(), count_params=True):
    """A student edition with 1.1 solved (unless not ``count_params``), the modules ``solved``
    from the solutions, and the cheats of tests/cheats/ named applied."""
    sub = student_edition(tmp_path / "sub", solved=solved)
    if count_params:
        replace_body(module(sub, "lab1/accounting.py"), "count_params", COUNT_PARAMS)
    for cheat in cheats:
        apply_cheat(sub / "src" / "labkit", cheat)
    return sub


def flagged(table, ex):
    return " | ".join(table["submission"]["flags"].get(ex, []))


def test_honest_work_in_unusual_styles_keeps_full_marks_and_no_flag(tmp_path, collected):
    """1.1 written with a frozen dataclass, a lambda table, functools.reduce, a static method, a
    computed getattr on its own object (fair_unusual_styles), next to helpers it does not use
    (fair_helpers): every point, no flag, nothing dropped. Beside it, in the same child, 1.2
    memoizing its last answer in its own class's constants (rt9a_fair_static_bytes_last_call_memo,
    which the child once refused, 1/9: it records no exercise module's class constants): full
    marks too."""
    sub = submission(tmp_path, "fair_unusual_styles", "fair_helpers",
                     "rt9a_fair_static_bytes_last_call_memo", count_params=False)
    table = grade(sub, collected, ["1.1", "1.2"])
    for ex, points in (("1.1", 5), ("1.2", 9)):
        e = table["exercises"][ex]
        assert e["earned"] == e["possible"] == points, (ex, [t["message"][:200] for t in e["tests"]])
    assert table["submission"]["flags"] == {} and table["submission"]["zeroed"] == {}
    assert table["submission"]["dropped"] == []


def test_a_blanket_pass_makes_the_tripwires_pass_and_voids_the_lab(tmp_path, collected, unread):
    """functools_reduce_getattr: 1.2's body reaches sys.modules by computed names and registers
    a pytest plugin that reports every test passed (before: 34/34 on lab 1). The reading zeroes
    it now (graded here without the reading); at run time the plugin set changed and the tripwire
    tests passed: the lab's run is void, 1.1's honest points included."""
    table = grade(submission(tmp_path, "functools_reduce_getattr"), collected, ["1.1", "1.2"])
    assert table["earned"] == 0, table["exercises"]
    assert "tampering" in flagged(table, "1.2")
    assert all(t["message"].startswith("void:") for e in table["exercises"].values()
               for t in e["tests"])


@pytest.mark.parametrize("cheat, needle", [("forged_records_on_every_fd", "two records for one test"),
                                           ("records_after_done", "after the test run said it was done")])
def test_forged_or_late_records_void_the_lab(tmp_path, collected, unread, cheat, needle):
    """Lines written on every file descriptor from 1.3's body (the result pipe is one): a second
    record for a test (the real plugin still sends its own), or records after a forged "done".
    There is no key to steal or signing function to call: the parent's rules void the run. (The
    reading zeroes both, os reached by computed names; graded here without it. Opening the pipe
    instead is refused: test_the_result_pipe_is_out_of_student_reach.)"""
    table = grade(submission(tmp_path, cheat), collected, ["1.1", "1.3"])
    assert table["earned"] == 0, table["exercises"]
    assert needle in flagged(table, "1.3")


def test_global_state_left_changed_is_put_back_and_fails_the_test(tmp_path, collected, unread):
    """Code that runs at import (a decorator, a default value, a constant, a class body, a
    decorator of the student's own) and exercise bodies that leave torch's default dtype, grad
    mode, global hooks, saved-tensor hooks or a dispatch mode changed; one that opens
    /proc/self/mem. The first test
    after each change fails, says what changed, and the state is put back; seeding torch at
    import changes nothing (the tests seed it themselves); the open is a flag. (Graded without the
    reading, which zeroes the saved-tensor hooks and the dispatch mode: measuring contexts.)"""
    sub = submission(tmp_path, "decorator_side_effect", "default_argument_side_effect",
                     "module_constant_side_effect", "own_decorator_runs_at_import",
                     "class_body_statement", "default_dtype_in_body", "mode_left_on")
    replace_body(module(sub, "lab1/accounting.py"), "activation_bytes",
                 load_cheat(CHEATS / "global_module_hook.txt")["code"])
    replace_body(module(sub, "lab1/accounting.py"), "predict_peak",
                 load_cheat(CHEATS / "read_process_memory.txt")["code"])
    apply_cheat(sub / "src" / "labkit", "saved_tensors_hooks_left_on")
    table = grade(sub, collected, ["1.1", "1.2", "1.3", "1.4", "1.5"])
    messages = " ".join(t["message"] for e in table["exercises"].values() for t in e["tests"])
    for needle in ("torch's grad mode", "torch's default dtype", "global module and optimizer hooks",
                   "dispatch modes", "saved-tensor hooks"):
        assert needle in messages, needle
    assert "files: opened /proc/" in flagged(table, "1.5")
    assert table["exercises"]["1.1"]["failed"] >= 1 and "refused at run time" in flagged(table, "1.1")
    assert table["exercises"]["1.2"]["earned"] == 0 and table["exercises"]["1.3"]["earned"] == 0


def test_shortcuts_are_refused_at_the_dispatcher_however_spelled(tmp_path, collected, unread):
    """Reached by computed names, which the reading cannot resolve: 5.6 through torch._VF's flash
    kernel (before: 17/22), 3.1 through the scale-update kernel (before: 15/15), 6.5 through
    F.gelu handed to a worker thread. Each operator is refused at PyTorch's dispatcher while the
    exercise's tests run; every test that reached one fails with the reason. (The reading now
    zeroes these, a module's names looked up by computed names: graded here without it.)

    In lab 3's child beside 3.1 (one child for both: make test's time), 3.2 stepping torch's
    Adam after removing the child's step hook by a handle given its key
    (rt8a_step_hook_removed_by_handle; before: 16/16): the hooks are compared after each test,
    which fails. (The reading zeroes the hook's removal too, as it re-registers a global hook:
    graded without it, the child's check holds alone.)

    And 3.8's wrong order (rt15w_zb_h1_wrong_order_agreed) beside a class body of 3.1's module
    that makes the tests' "torch plan" agree with it, replacing a method of pipelining's
    ScheduleInterleavedZeroBubble (rt15w_zero_bubble_reference_replaced_from_loss_scaler; before:
    the plan test passed, 3.8 unflagged): the child records the torch modules the
    references and the tests import, in a function too: put back, 3.1's test fails, 3.8's too."""
    sub = submission(tmp_path, "vf_flash_attention_computed", "amp_update_scale_computed",
                     "gelu_on_worker_thread", "rt8a_step_hook_removed_by_handle",
                     "rt15w_zero_bubble_reference_replaced_from_loss_scaler",
                     "rt15w_zb_h1_wrong_order_agreed",
                     solved=("lab5/flash_attention.py", "lab3/loss_scaler.py", "lab6/fusion.py",
                             "lab3/mixed_precision.py", "lab3/zero_bubble.py"))
    table = grade(sub, collected, ["3.1", "3.2", "3.8", "5.6", "6.5"])
    assert "_calculate_single_rank_operations was rebound" in flagged(table, "3.1")
    assert any("torch plans" in t["message"] for t in table["exercises"]["3.8"]["tests"])
    e = table["exercises"]["3.2"]
    assert e["earned"] < e["possible"] and any(
        "hooks were replaced" in t["message"] for t in e["tests"] if t["outcome"] != "passed"), \
        ("rt8a_step_hook_removed_by_handle", [t["message"][:200] for t in e["tests"]])
    for ex, needle in (("5.6", "rebuilds PyTorch's SDPA"), ("3.1", "rebuilds GradScaler"),
                       ("6.5", "rebuilds PyTorch's gelu")):
        e = table["exercises"][ex]
        assert e["earned"] < e["possible"], (ex, e)
        assert any(needle in t["message"] and "refused while grading" in t["message"]
                   for t in e["tests"]), (ex, [t["message"][:200] for t in e["tests"]])
        assert "refused at run time" in flagged(table, ex)


WATCHED_BESIDE = {  # 5.6's cheat -> 5.9's, graded in the same lab-5 child, and where it is seen
    "attention_on_worker_thread": ("rt12a_ce_numpy_by_asarray",
                                   "__array__ (from chunked_cross_entropy.py:"),
    "attention_in_dataloader_worker": ("rt13a_ce_python_by_tolist_on_pool_thread",
                                       "tolist (from a thread of the test)")}


@pytest.mark.parametrize("cheat", ["attention_on_worker_thread", "attention_in_dataloader_worker",
                                   "return_zeros"])
def test_a_measurement_cannot_be_dodged(tmp_path, collected, cheat):
    """5.6's memory and FLOP tests: an O(S²) attention whose products run on a worker thread
    (where MemTracker and the FLOP counter of the test's thread see nothing; before: 22/22) is
    refused there; one run in a DataLoader's worker process (before: the forked worker ended the
    lab's test process) is refused when the worker is started; a forward returning zeros
    (before: 4/22) fails the measurement tests too, which now check the output they measured.
    Not one point of 5.6.

    Beside the first two, in the same child (one lab-5 child for both: make test's time), the
    Watch is on for every measured exercise: 5.9's forward computed in numpy, graded as an
    instructor grades, the data taken out of torch on the test's thread
    (rt12a_ce_numpy_by_asarray) and on a pool's (rt13a_ce_python_by_tolist_on_pool_thread;
    25/25 before, with a threads flag only): the points stand, the flag for review says what
    left torch and where."""
    beside, where = WATCHED_BESIDE.get(cheat, (None, None))
    sub = submission(tmp_path, cheat, *filter(None, [beside]), solved=(
        "lab5/flash_attention.py", *(["lab5/chunked_cross_entropy.py"] if beside else [])))
    table = grade(sub, collected, ["5.6", "5.9"] if beside else ["5.6"])
    e = table["exercises"]["5.6"]
    assert e["earned"] == 0, [(t["test"], t["outcome"]) for t in e["tests"]]
    if cheat == "return_zeros":
        assert any("not attention's" in t["message"] for t in e["tests"])
    elif cheat == "attention_in_dataloader_worker":
        assert "os.fork from student code" in flagged(table, "5.6")
    else:
        assert "threads" in flagged(table, "5.6") and "not the course's" in flagged(table, "5.6")
    if beside:
        assert "measured elsewhere: over 1024 elements" in flagged(table, "5.9"), beside
        assert where in flagged(table, "5.9"), (beside, flagged(table, "5.9"))


@pytest.mark.parametrize("cheat", ["rt12a_ce_numpy_by_asarray", "rt12a_ce_numpy_by_dlpack",
                                   "rt12a_ce_python_by_tolist",
                                   "rt13a_ce_numpy_by_one_element_view_strided",
                                   "rt13a_ce_python_by_int_of_scaled_elements",
                                   "rt13a_ce_python_by_str_of_tensor",
                                   "rt14a_ce_python_by_apply_callback",
                                   "rt14a_ce_python_by_bool_bits",
                                   "rt15b_chunked_ce_forward_print_tensor",
                                   "rt15w_ce_numpy_by_tensor_split_shapes",
                                   "rt15w_ce_numpy_by_mask_lengths",
                                   "rt15w_ce_numpy_by_sparse_counts",
                                   "rt15w_fair_ce_forward_tensor_split_masked_rows", None])
def test_tensor_data_taken_out_of_torch_is_flagged_where_the_tests_measure(tmp_path, monkeypatch,
                                                                           cheat):
    """5.9 computed whole in numpy or Python, the data moved by ``np.asarray`` (numpy's
    functions call ``Tensor.__array__``), DLPack or ``.tolist()`` (rt12a), by a one-element view
    widened with ``as_strided``, ``int()`` of scaled elements or the tensor's text (rt13a), a
    callback of ``apply_``, ``bool()`` of bit planes (rt14a), the lengths of ``tensor_split``'s
    pieces at split points given as a tensor or of boolean-masked selections (rt15w): no
    name the reading looks for, 21-25/25 before. The child's ``Watch`` mode (the one every measured exercise's tests run under)
    sees each route and raises "measured elsewhere" for review; the reference solution gets no
    flag, nor one that prints its 1,100 log-sum-exps (rt15b: torch prints a summary past its
    threshold, a few elements, counted as such), nor one that splits its chunks by tensor_split
    and picks its rows by boolean masks (rt15w: a mask's count is one number). Run here in this process, the cheat's module
    marked as student code."""
    import importlib.util
    import os
    import shutil

    import torch

    from labkit.grade import child

    shutil.copytree(ROOT / "solutions" / "labkit", tmp_path / "labkit")
    path = tmp_path / "labkit" / "lab5" / "chunked_cross_entropy.py"
    if cheat:
        path = apply_cheat(tmp_path / "labkit", cheat)
    spec = importlib.util.spec_from_file_location(f"ce_{cheat}", path)
    ce = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ce)
    monkeypatch.setattr(child, "STUDENT", {os.path.realpath(path): [(1, 10**6)]})
    for name, value in (("flags", []), ("moved", 0), ("kinds", {})):
        monkeypatch.setattr(child.State, name, value)
    fair = cheat is None or "fair" in load_cheat(CHEATS / f"{cheat}.txt")
    n = 1100 if fair else 48  # (past torch's print threshold, 1,000: printed as a summary)
    hidden, weight = torch.randn(n, 16, requires_grad=True), torch.randn(100, 16, requires_grad=True)
    with child.Watch():
        ce.chunked_cross_entropy(hidden, weight, torch.randint(0, 100, (n,)), 16).backward()
    assert fair != any(f.startswith("measured elsewhere") for f in child.State.flags), \
        child.State.flags


@pytest.mark.parametrize("forked", [False, True])
def test_in_a_rank_tensor_data_taken_out_of_torch_is_refused(tmp_path, monkeypatch, forked):
    """rt15b2_zero3_full_parameters_kept_as_python_floats: 3.7 kept every unit's full parameters
    as Python floats in its ranks (32/32, no flag: the Watch ran in the test's process only, and
    a rank's flags have no way back). A rank of a measured exercise now watches (a fresh one from
    guard(), a forked one inherits the test's), and refuses there what would be flagged (2/32,
    graded). Here 5.9's tolist cheat under a rank's Watch, in this process (a forked rank: another
    pid)."""
    import importlib.util
    import os
    import shutil

    import torch

    from labkit.grade import child

    path = apply_cheat(shutil.copytree(ROOT / "solutions" / "labkit", tmp_path / "labkit"),
                       "rt12a_ce_python_by_tolist")
    spec = importlib.util.spec_from_file_location("ce_rank", path)
    ce = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ce)
    monkeypatch.setattr(child, "STUDENT", {os.path.realpath(path): [(1, 10**6)]})
    for name, value in (("flags", []), ("moved", 0), ("kinds", {}), ("pid", -1 if forked else os.getpid())):
        monkeypatch.setattr(child.State, name, value)
    hidden, weight = torch.randn(48, 16, requires_grad=True), torch.randn(100, 16, requires_grad=True)
    with child.Watch(rank=not forked), pytest.raises(PermissionError, match="in a rank: over 1024"):
        ce.chunked_cross_entropy(hidden, weight, torch.randint(0, 100, (48,)), 16).backward()
    assert not child.State.flags


def test_a_module_may_read_its_own_source_not_the_tests(tmp_path, monkeypatch):
    """rt15b_fusion_jit_script_helper: ``@torch.jit.script`` reads the student's own module
    (inspect, linecache) to compile it, which was flagged "files" (7/7 with the flag): a
    read-only open of a student module of the graded copy is fair. A test file read from
    exercise code (rt15c_answers_read_from_the_tests_file) is still flagged for review, and so is
    the student's module opened for writing. The child's audit hook called as an open from the
    student's code would call it."""
    from labkit.grade import child

    own, tests = tmp_path / "fusion.py", tmp_path / "test_lab6_fusion.py"
    own.write_text("import torch\n" * 3)
    tests.write_text("")
    monkeypatch.setattr(child, "STUDENT", {str(own.resolve()): [(1, 3)]})
    for name, value in (("flags", []), ("kinds", {}), ("exercise", "6.5")):
        monkeypatch.setattr(child.State, name, value)
    for path, mode in ((own, "r"), (tests, "r"), (own, "a")):
        opening = compile(f"audit('open', ({str(path)!r}, {mode!r}, 0))", str(own), "exec")
        exec(opening, {"audit": child._audit})
    assert child.State.flags == [f"files: opened {p.resolve()} (from fusion.py:1)"
                                 for p in (tests, own)], child.State.flags


@pytest.mark.parametrize("cheat", ["widen_shared_tolerance", "patch_assert_close_through_a_partial",
                                   "patch_inside_assert_close_through_a_partial",
                                   "patch_assert_close_at_import"])
def test_shared_tolerances_and_comparisons_cannot_be_changed(tmp_path, collected, unread, cheat):
    """widen_shared_tolerance: 5.6's forward reaches the tests' modules by computed names, tries
    to widen ATTN_TOL in place and to rebind it, then returns an answer off by 1e-3. The dict
    is read-only, the rebinding is put back and fails the test: no forward test passes.
    patch_assert_close_through_a_partial: torch.testing.assert_close rebound through a module
    reached by a computed name and a partial's call (before: 4/22 with a forward of zeros), or
    the function it calls inside torch.testing._comparison
    (patch_inside_assert_close_through_a_partial): the functions of the modules the tests
    compare with are put back after each test, which fails: not one point. Rebound at
    import, before a test ran (patch_assert_close_at_import, with a forward of zeros): recorded
    before any student code was imported, the change voids the lab's run."""
    extra = ("return_zeros",) if cheat == "patch_assert_close_at_import" else ()
    sub = submission(tmp_path, cheat, *extra, solved=("lab5/flash_attention.py",))
    table = grade(sub, collected, ["5.6"])
    tests = table["exercises"]["5.6"]["tests"]
    forward = [t for t in tests if "forward" in t["test"]]
    assert forward and all(t["outcome"] == "failed" for t in forward), forward
    if cheat != "widen_shared_tolerance":
        assert table["exercises"]["5.6"]["earned"] == 0, [(t["test"], t["outcome"]) for t in tests]
        assert "was rebound" in flagged(table, "5.6")


LAUNDERED = {"laundered_by_computed_setattr": ("1.1", "count_params"),
             "laundered_by_vars_item": ("1.2", "static_bytes"),
             "laundered_by_partial_call": ("1.3", "activation_bytes"),
             "exception_args_foreign_class": ("1.5", "predict_peak")}


def test_a_class_of_torch_patched_through_a_laundered_name_is_put_back(tmp_path, collected):
    """torch.nn.Module._named_members (under parameters(), which the tests' references count)
    replaced through names the reading cannot follow: an attribute set by a computed name, an
    item of an object's namespace, a partial's call, an exception's argument, one shape per
    exercise of lab 1, each returning 0. The child records torch.nn's classes before any student code is imported and
    puts them back after each test, which fails: 1.1 (whose reference the patch zeroes) earns
    nothing, and each exercise says what was rebound."""
    sub = student_edition(tmp_path / "sub")
    for cheat, (_, function) in LAUNDERED.items():
        apply_cheat(sub / "src" / "labkit", {**load_cheat(CHEATS / f"{cheat}.txt"),
                                             "edit": f"body {function}"})
    table = grade(sub, collected, ["1.1", "1.2", "1.3", "1.5"])
    assert table["exercises"]["1.1"]["earned"] == 0, table["exercises"]["1.1"]
    for cheat, (ex, _) in LAUNDERED.items():
        assert "Module._named_members was rebound" in flagged(table, ex), (cheat, flagged(table, ex))


@pytest.mark.parametrize("cheat", ["rt7a_adam_class_from_toolkit_instance",
                                   "rt7a_adam_class_from_torch_table",
                                   "rt7b_unpickle_bytes_via_datapipes_decoder",
                                   "rt15w_adam_step_borrowed_by_own_optimizer",
                                   "rt15w_adam_step_as_own_class_attribute"])
def test_what_an_exercise_rebuilds_is_refused_however_it_was_reached(tmp_path, collected, cheat):
    """3.2 handed to torch's Adam, its class reached with no name the reading can match: the
    type of a toolkit object's optimizer, an element of a table of torch's, a class unpickled from
    bytes by a public torch function (before: 16/16, 14/16, 14/16), or Adam's step function called
    on an Optimizer subclass of the student's own, or made its class's step (rt15w; before: 16/16,
    16/16). Every torch optimizer's
    step runs the global pre-hooks, where the child refuses the one the exercise rebuilds (its
    class or the step function that runs) when student code steps it; unpickling from student
    code is refused whatever function does it. 0/16, each test saying why."""
    sub = submission(tmp_path, cheat, solved=("lab3/mixed_precision.py",), count_params=False)
    table = grade(sub, collected, ["3.2"])
    e = table["exercises"]["3.2"]
    assert e["earned"] == 0, [(t["test"], t["outcome"]) for t in e["tests"]]
    needle = load_cheat(CHEATS / f"{cheat}.txt")["needle"]
    assert any(needle in t["message"] for t in e["tests"]), [t["message"][:200] for t in e["tests"]]
    assert "refused at run time" in flagged(table, "3.2")


@pytest.mark.parametrize("cheat, exercise, needle", [
    ("rt8a_adam_step_on_course_io_thread", "2.7", "torch.optim.adam.Adam.step is refused"),
    ("rt8a_clean_rank_from_course_thread", "2.7", "refused while grading"),
    ("rt8a_fair_copy_copy_master", "3.2", None), ("rt8a_fair_own_adam_class_stepped", "3.2", None)])
def test_work_handed_to_a_course_thread_is_refused_and_honest_work_is_not(tmp_path, collected,
                                                                           cheat, exercise, needle):
    """2.7's step handed to the course's own I/O pool (torch's Adam stepped there: before, 24/24)
    or a spawned rank started from it: a thread started during a test is refused what student
    code is refused, whoever calls. Honest 3.2 work the child once refused (0/16): a master made
    with copy.copy (pickling caches Tensor.__slotnames__, now cached before the record) and the
    student's own Optimizer subclass named Adam (the step hook judges library classes only): full
    marks. (3.2 stepping torch's Adam after removing the child's step hook by a handle is graded
    in lab 3's child of test_shortcuts_are_refused_at_the_dispatcher_however_spelled; 1.2
    memoizing in its own class's constants in lab 1's of
    test_honest_work_in_unusual_styles_keeps_full_marks_and_no_flag.)"""
    module_ = {"2.7": "lab2/nvme_offload.py", "3.2": "lab3/mixed_precision.py"}[exercise]
    sub = submission(tmp_path, cheat, solved=(module_,), count_params=False)
    e = grade(sub, collected, [exercise])["exercises"][exercise]
    messages = [t["message"][:200] for t in e["tests"] if t["outcome"] != "passed"]
    if needle is None:
        assert e["earned"] == e["possible"], messages
    else:
        assert e["earned"] < e["possible"] and any(needle in m for m in messages), messages


OPTIM_PATCHES = ("rt9b_cached_lambda_gives_foreign_class", "rt9b_dataclass_default_factory",
                 "rt9b_enum_member_by_subscript", "rt9b_exception_args_foreign",
                 "rt9b_helper_called_from_list", "rt9b_instance_method_result_patched",
                 "rt9b_map_lambda_returns_foreign", "rt9b_numpy_object_array_element",
                 "rt9b_own_subclass_mro_reaches_base", "rt9b_partial_of_next_over_foreign",
                 "rt9b_property_built_by_call", "rt9b_reduce_lambda_returns_foreign",
                 "rt9b_singledispatch_registered_returns_foreign", "rt9b_torch_identity_function",
                 "rt9b_weakref_dereferenced")
LAB1 = {"1.1": "count_params", "1.2": "static_bytes", "1.3": "activation_bytes",
        "1.4": "korthikanti_activation_bytes", "1.5": "predict_peak"}


@pytest.mark.parametrize("group", range(3))
def test_torch_optim_patched_where_the_reading_cannot_follow_is_put_back(tmp_path, collected, group):
    """torch.optim.SGD.step replaced through fifteen routes the reading does not follow (a cached
    or mapped lambda, a dataclass's default factory, an Enum member, a weak reference, an object
    array, torch.jit.annotate...; rt9b), five at a time, one per exercise of lab 1: the child
    records torch.optim's (and torch.autograd's) classes and functions before any student code,
    puts each change back after the test and fails it, saying what was rebound."""
    cheats = OPTIM_PATCHES[group * 5:group * 5 + 5]
    sub = student_edition(tmp_path / "sub")
    for cheat, function in zip(cheats, LAB1.values()):
        apply_cheat(sub / "src" / "labkit", {**load_cheat(CHEATS / f"{cheat}.txt"),
                                             "edit": f"body {function}"})
    table = grade(sub, collected, list(LAB1))
    for cheat, ex in zip(cheats, LAB1):
        assert "SGD.step was rebound" in flagged(table, ex), (cheat, flagged(table, ex))


def test_the_modes_the_tests_and_the_child_measure_with_are_recorded(tmp_path, collected):
    """A class body of 5.1's module replaces TorchDispatchMode's __enter__ and __exit__ (its class
    reached as the MRO of a subclass of the public CommDebugMode), and one of 5.5's (which may name
    measuring contexts) TorchFunctionMode's __enter__: before, no change was seen, and the modes
    entered later never were (the child's Refuse and Watch, MemTracker, the tests' counters): 5.4
    taking every output out of torch by .tolist() lost its "measured elsewhere" flag (rt15w).
    The child records the modules the modes (torch.overrides too) and MemTracker are defined in: each patch is put back and fails its test; 5.4 keeps its flag."""
    sub = submission(tmp_path, "rt15w_class_body_unhooks_torch_dispatch_modes",
                     "rt15w_offload_class_body_unhooks_torch_function_modes",
                     "rt15w_output_bytes_by_tolist_len", count_params=False, solved=(
                         "lab5/checkpointing.py", "lab5/offload.py", "lab5/selective_checkpoint.py"))
    table = grade(sub, collected, ["5.1", "5.4", "5.5"])
    assert "TorchDispatchMode.__enter__ was rebound" in flagged(table, "5.1"), flagged(table, "5.1")
    assert "TorchFunctionMode.__enter__ was rebound" in flagged(table, "5.5"), flagged(table, "5.5")
    assert "measured elsewhere" in flagged(table, "5.4"), flagged(table, "5.4")


def test_torch_autograd_patched_through_a_table_of_torch_is_put_back(tmp_path, collected):
    """6.5's backward replaces torch.autograd.gradcheck, reached as a key of
    torch.overrides.get_overridable_functions() (before: the gradcheck test passed with a wrong
    backward): recorded before any student code, put back after the test, which fails."""
    sub = submission(tmp_path, "rt9b_overridable_functions_give_torch", solved=("lab6/fusion.py",),
                     count_params=False)
    table = grade(sub, collected, ["6.5"])
    assert table["exercises"]["6.5"]["earned"] == 0, table["exercises"]["6.5"]
    assert "gradcheck was rebound" in flagged(table, "6.5")


@pytest.mark.parametrize("cheat", ["rt11a_forged_records_then_segfault",
                                   "rt11a_forged_records_with_tripwires_and_done"])
def test_the_result_pipe_is_out_of_student_reach(tmp_path, collected, cheat):
    """1.1 writing "passed" records on every file descriptor the child might hold, then crashing
    it before the genuine records come (the second also forging the tripwires' records, their
    names read from the test file, and "done"): 34/34 before. Opening a file descriptor, or a
    file outside the scratch folder for writing, from student code is refused (audit hook), so
    nothing reaches the pipe: the crash leaves 1.1's tests without a result, 0 points."""
    sub = submission(tmp_path, cheat, count_params=False)
    e = grade(sub, collected, ["1.1"])["exercises"]["1.1"]
    assert e["earned"] == 0, [(t["test"], t["outcome"], t["message"][:120]) for t in e["tests"]]


DYING_CHILD = '''
import collections, gc, os, signal, weakref

import pytest

from labkit.grade import child

FORGED = '{"kind": "test", "nodeid": "tests/test_dying.py::test_c", "outcome": "passed"}\\n'
WRITE = type(open(os.devnull, "w")).write


class Junk:
    """A node of a cycle of garbage: its finalizer runs from whatever allocates, no test's frame."""


class Stop(KeyboardInterrupt):
    def __str__(self):  # pytest's report of the interrupt reads it: the process dies there
        os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.exercise("1.5", points=1)
def test_a():
    fd = child.SPEC["fd"]
    for target in (fd, f"/proc/self/fd/{fd}", f"/dev/fd/{fd}"):
        junk = Junk()
        junk.me = junk
        files = map(open, [target], ["w"], [1], [None], [None], [None], [target != fd])
        weakref.finalize(junk, collections.deque, map(WRITE, files, [FORGED]), 0)
        del junk
        gc.collect()


@pytest.mark.exercise("1.5", points=1)
def test_b():
    raise Stop()


@pytest.mark.exercise("1.5", points=1)
def test_c():
    pass
'''


def test_a_child_that_dies_keeps_what_its_tests_finished_and_no_finalizer_reaches_the_pipe(tmp_path):
    """The child's records and pipe, in a child of three tests without a wall (as root here: only
    the child's refusal, which every wall adds to). rt15c_gc_finalizer_map_open_fd_forges_records
    (6/7 forged before) and rt15c_gc_finalizer_logging_forges_records: a finalizer the cyclic GC
    runs, no student frame on the stack, opens the pipe by its number, /proc/self/fd/N or
    /dev/fd/N: each refused, whoever calls (and the pipe's mode 0 refuses the paths to a child
    without capabilities, behind every wall), the test failed saying so, no forged record.
    rt15c_keyboardinterrupt_str_segfault (a pass before): a KeyboardInterrupt in a test's call
    leaves its record failed, and its __str__ then kills the child: the records of the tests it
    finished are kept, the tests after it get none (and one it dies in fails saying so: see
    test_the_parent_refuses_a_pipe_it_cannot_trust)."""
    from labkit.grade import isolation

    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_dying.py").write_text(DYING_CHILD)
    (tmp_path / "src").symlink_to(ROOT / "src")
    (tmp_path / "scratch").mkdir()
    prep = runner.Prepared(tmp_path, {})
    lines, note = runner.run_child(prep, ["tests/test_dying.py"], ["1.5"], tmp_path / "scratch",
                                   300, isolation.Isolation("none", "a test of the child"))
    a, b, c = (f"tests/test_dying.py::test_{x}" for x in "abc")
    records, void = runner.read_records(lines, {a, b, c}, set())
    assert not void and set(records) == {a, b}, (void, lines, note[-2000:])
    assert records[a]["outcome"] == "failed" and records[a]["message"].count("the result pipe") == 3
    assert records[b]["outcome"] == "failed" and "stopped before its own run" in records[b]["message"]
    assert not any(c in line for line in lines) and "ended before it finished" in note, note


_FLASH = "tests/test_lab5_flash_attention.py::"
_FLASH_FLOPS = _FLASH + "test_causal_flash_skips_the_tiles_above_the_diagonal"
_FLASH_SAVED = _FLASH + "test_flash_saves_only_inputs_output_and_log_sum_exp"
_GELU_SAVED = "tests/test_lab6_fusion.py::test_fused_gelu_saves_only_its_input"
_CE_SAVED = "tests/test_lab5_chunked_cross_entropy.py::test_backward_keeps_no_logits"
_ADAM8 = "tests/test_lab2_adam8bit.py::"


CHEAT_RUNS = [  # (cheat, the test that catches it, a phrase of its failure)
    ("rt11a_inputs_zeroed_before_the_reference",
     _FLASH + "test_flash_forward_matches_sdpa", "flash_attention_forward changed q in place"),
    ("rt11a_memo_replays_the_baseline_call",
     "tests/test_lab4_grad_accumulation.py::test_accumulation_activation_peak_is_one_micro_batch",
     "with k = "),  # (k = 4's peak, or now k = 1's, answered from the memo: no bytes saved)
    # rt12a, one test each that catches the cheat (one pytest run a cheat: make test's cost)
    ("rt12a_flash_backward_zeroes_grad_out", _FLASH_FLOPS,
     "flash_attention_backward changed grad_out in place"),
    ("rt12a_flash_backward_rewrites_inputs_and_output", _FLASH_FLOPS,
     "flash_attention_backward changed q in place"),
    ("rt12a_flash_saved_bytes_test_inputs_zeroed", _FLASH_SAVED,
     "flash_attention's forward changed q in place"),
    ("rt12a_flash_backward_hooks_on_the_tests_leaves", _FLASH + "test_flash_backward_matches_sdpa_gradients",
     "flash_attention (forward, then backward) left a hook on q"),
    ("rt12a_gelu_backward_zeroes_grad_out", _GELU_SAVED,
     "fused_gelu_tanh's backward changed grad_out in place"),
    ("rt12a_gelu_backward_hooks_on_the_tests_input",
     "tests/test_lab6_fusion.py::test_fused_gelu_matches_torch_gelu_tanh",
     "fused_gelu_tanh's backward left a hook on x"),
    ("rt12a_ce_inputs_zeroed_in_forward", _CE_SAVED,
     "chunked_cross_entropy's forward changed hidden in place"),
    ("rt12a_ce_probabilities_kept_on_ctx", _CE_SAVED, "or kept as ctx attributes"),
    ("rt12a_adam8bit_nan_scales_hide_fp32_moments",  # NaN scales against the stored moments
     _ADAM8 + "test_adam8bit_first_step_is_adam_and_stores_quantized_moments", "elements differ"),
    ("rt12a_adam8bit_nan_scales_hide_fp32_moments",  # fp32 moments kept outside opt.state
     _ADAM8 + "test_adam8bit_state_is_two_bytes_per_parameter_plus_scales",
     "not in another attribute"),
    # rt14a: a block run twice in the forward, none in backward; saved-tensor hooks left on
    ("rt14a_checkpoint_forward_twice_without_recompute", "tests/test_lab5_checkpointing.py::"
     "test_each_recomputed_block_runs_forward_twice_and_the_others_once", "in the forward"),
    ("rt14a_offload_wrong_unpack_hooks_left_for_reference", "tests/test_lab5_offload.py::"
     "test_offloaded_gradients_equal_the_plain_model", "left torch's saved-tensor hooks"),
    # rt15a: 2.4's gradients cloned out of MemTracker's "gradients" and applied at the end
    ("rt15a_lomo_grads_cloned_out_of_the_gradient_category", "tests/test_lab2_lomo.py::"
     "test_lomo_peak_gradient_bytes_is_the_largest_gradient", "cloned, stacked"),
    # rt15a: a 0-d bf16 tensor compares with the exact count in bf16
    ("rt15a_korthikanti_bf16_tensor_answer", "tests/test_lab1_accounting.py::"
     "test_korthikanti_equals_the_published_formula", "return the exact count as a Python int"),
    # rt16a: 5.6 as strips of query rows against all keys; 5.7's work paid by a dummy call
    ("rt16a_flash_query_rows_without_online_softmax_fwd", _FLASH_FLOPS, "more than one"),
    ("rt16a_flash_query_rows_without_online_softmax_bwd", _FLASH_FLOPS, "more than one"),
    # rt15w: the same rows by torch.mv (a matrix-vector product), or by broadcast products and
    # sums (no product operator: the row's softmax reduces over all its keys)
    ("rt15w_flash_rows_by_mul_sum_fwd", _FLASH_FLOPS, "more than one"),
    ("rt15w_flash_rows_by_mv_bwd", _FLASH_FLOPS, "more than one"),
    ("rt16a_ring_work_counter_paid_by_a_dummy_call", "tests/test_lab5_ring_attention.py::"
     "test_zigzag_ring_work_is_equal_on_every_rank", "at the dispatcher"),
    # rt16a: 4.1's one whole-batch backward hidden under checkpoint's saved-tensor hooks (its own
    # call, or the course's 5.2 segment class); 5.3 optimal only on short chains; 7.2 only the
    # rules BAD_PLANS tried
    ("rt16a_accumulate_one_backward_under_checkpoint",
     "tests/test_lab4_grad_accumulation.py::test_accumulation_activation_peak_is_one_micro_batch",
     "could not be measured"),
    ("rt16a_accumulate_shadowed_by_the_course_segment_class",
     "tests/test_lab4_grad_accumulation.py::test_accumulation_activation_peak_is_one_micro_batch",
     "could not be measured"),
    ("rt16a_optimal_schedule_brute_force_small_uniform_large", "tests/test_lab5_checkpointing.py::"
     "test_optimal_schedule_has_the_least_recompute_a_brute_force_search_finds", "on long chains too"),
    ("rt16a_check_plan_only_the_tested_rules", "tests/test_lab7_run_plan.py::"
     "test_a_plan_the_ranks_cannot_run_is_refused_naming_the_argument",
     "which the docstring's rules refuse"),
    # rt15b2: what ctx or an optimizer keeps inside a container the walk did not open (a deque,
    # an iterator, a generator, nine lists deep, a tensor's own attribute, __slots__)
    ("rt15b2_ce_probabilities_kept_in_deque", _CE_SAVED, "or kept as ctx attributes"),
    ("rt15b2_ce_probabilities_kept_in_list_iterator", _CE_SAVED, "or kept as ctx attributes"),
    ("rt15b2_ce_probabilities_kept_in_generator", _CE_SAVED, "or kept as ctx attributes"),
    ("rt15b2_ce_probabilities_kept_in_nine_lists_deep", _CE_SAVED, "or kept as ctx attributes"),
    ("rt15b2_ce_probabilities_kept_in_tensor_attribute", _CE_SAVED, "or kept as ctx attributes"),
    ("rt15b2_ce_probabilities_kept_in_slots_object", _CE_SAVED, "or kept as ctx attributes"),
    # rt15b2: 5.9's softmax saved as a view of an nn.Parameter of its own (the hooks skip
    # parameters: ctx_bytes counts a Function's saved parameters)
    ("rt15b2_ce_probabilities_saved_as_parameters", _CE_SAVED, "or kept as ctx attributes"),
    ("rt15b2_ce_probabilities_kept_in_weakref_finalize", _CE_SAVED, "or kept as ctx attributes"),
    ("rt15b2_adam8bit_fp32_moments_in_weakref_finalize",
     _ADAM8 + "test_adam8bit_state_is_two_bytes_per_parameter_plus_scales", "not in another attribute"),
    ("rt15b2_gelu_tanh_kept_in_a_deque_on_ctx", _GELU_SAVED, "save only the input x"),
    ("rt15b2_adam8bit_fp32_moments_in_a_deque",
     _ADAM8 + "test_adam8bit_state_is_two_bytes_per_parameter_plus_scales", "not in another attribute"),
]


def _shared_runs(runs: list) -> list[list]:
    """The runs in as few pytest processes as can share them (each process costs seconds of
    make test's budget): a copy of the solutions takes one cheat per module, so that no cheat
    meets another's effects (the same cheat may serve several tests)."""
    groups: list[tuple[dict, list]] = []
    for run in runs:
        module = load_cheat(CHEATS / f"{run[0]}.txt")["module"]
        group = next((g for g in groups if g[0].get(module, run[0]) == run[0]), None)
        if group is None:
            groups.append(group := ({}, []))
        group[0][module] = run[0]
        group[1].append(run)
    return [runs for _, runs in groups]


def _failures(junit: Path) -> dict[str, str]:
    """{node id: its failure's or error's text} of a pytest JUnit XML report."""
    import xml.etree.ElementTree as ET

    out = {}
    for case in ET.parse(junit).iter("testcase"):
        nodeid = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        out[nodeid] = " ".join(f"{e.get('message', '')} {e.text or ''}" for e in case
                               if e.tag in ("failure", "error"))
    return out


@pytest.mark.parametrize("runs", _shared_runs(CHEAT_RUNS),
                         ids=lambda runs: "+".join(dict.fromkeys(c.split("_", 1)[1][:24]
                                                                  for c, _, _ in runs)))
def test_what_a_test_compares_with_is_not_the_exercises_to_choose(tmp_path, runs):
    """5.6's forward zeroing the test's q and v in place and returning attention of zeros (8/22
    when the reference was computed after the call, from the same tensors); 4.1 answering the
    measured k = 4 call from a memo of the test's own k = 1 run (full marks when k = 1 ran
    first). rt12a: a backward (5.6, 6.5) zeroing grad_out, or q, v and the forward's O, or
    leaving gradient hooks on the test's leaves; 5.9's forward zeroing hidden and weight, or
    keeping its probabilities as a ctx attribute; 2.3 hiding fp32 moments outside opt.state
    behind NaN scales. rt14a: 5.2 running each segment's blocks twice in the forward (a
    pre-hook) and recomputing nothing; 5.5 leaving its saved-tensor hooks installed for the
    test's reference (a finalizer took them off later; its constants:
    rt14a_offload_wrong_unpack_hooks_left_for_reference_table). rt15a: 2.4 cloning each
    gradient into a list and applying them all at the last hook; 1.4 answering with a bf16 tensor
    (compared in bf16). rt16a: 5.6's forward or backward as strips of query rows against all
    keys (no key tiles, no online softmax; rt15w: by torch.mv, or products and sums, a row at a
    time); 5.7 computing every block whole and masked, paying
    count_attention_work with a dummy call (the tiles' and the ranks' products are now seen at
    the dispatcher); 4.1 one whole-batch backward under torch.utils.checkpoint's saved-tensor
    hooks (peak_saved_bytes now refuses to measure through other hooks); 5.3 exact only on short
    chains (long random chains against the grader's exact search); 7.2 only the rules BAD_PLANS
    tried (a plan per rule of the docstring). The tests now check that what they gave student
    code is as given (tests/_given.py), count ctx attributes and all the optimizer holds, count
    NaN as a mismatch, and measure k = 4 first: with the reference solutions plus the cheat (plain
    pytest, the cheats of other modules beside it), the test fails, saying why. rt15b2: 5.9's
    softmax or 2.3's fp32 moments kept in a deque, an iterator, a generator, nine lists deep, a
    tensor's attribute or __slots__ (tests/_given.py's walk now follows every reference)."""
    import os
    import shutil
    import subprocess
    import sys

    shutil.copytree(ROOT / "solutions" / "labkit", tmp_path / "labkit")
    for cheat in dict.fromkeys(c for c, _, _ in runs):
        apply_cheat(tmp_path / "labkit", cheat)
        if (CHEATS / f"{cheat}_table.txt").exists():  # (a constant the cheat needs)
            apply_cheat(tmp_path / "labkit", f"{cheat}_table")
    junit = tmp_path / "report.xml"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           f"--junitxml={junit}", *dict.fromkeys(t for _, t, _ in runs)],
                          cwd=ROOT, env={**os.environ, "LABKIT_SOLUTIONS": str(tmp_path)},
                          capture_output=True, text=True, timeout=600)
    failures = _failures(junit) if junit.exists() else {}
    for cheat, test, needle in runs:  # (a parametrized test: any of its cases)
        text = " ".join(v for k, v in failures.items() if k == test or k.startswith(f"{test}["))
        assert needle in text, (cheat, test, text[-1500:] or "(no failure)", done.stdout[-1500:])
