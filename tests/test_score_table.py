"""labkit.score_table, the pytest plugin behind `pytest --grade`: a fair table that a stub cannot game and that names what was not attempted."""
import json

import pytest

GRADED = '''
import pytest

def stub():
    raise NotImplementedError("exercise 9.1: write it (labs/09_x.ipynb)")

@pytest.mark.exercise("9.1", points=3)
def test_attempted_nothing():
    stub()

@pytest.mark.exercise("9.2", points=2)
def test_right():
    assert 1 + 1 == 2

@pytest.mark.exercise("9.2", points=1)
def test_wrong():
    assert 1 + 1 == 3, "one plus one is two"

@pytest.mark.exercise("9.3", points=1)
@pytest.mark.skipif(True, reason="needs CUDA")
def test_gpu():
    pass

def test_not_graded():
    pass

@pytest.mark.exercise("9.4", points=2)
def test_missing_reference():
    assert 2 + 2 == 4, "the student's part passes first"
    from labkit.score_table import optional_reference
    optional_reference("no_such_module_for_labkit_tests")

@pytest.mark.exercise("9.4", points=1)
def test_old_reference():
    from labkit.score_table import optional_reference
    optional_reference("pytest", min_version="999.0")

@pytest.mark.exercise("9.5", points=1)
def test_introspection_hidden():
    got, want = [4368], [3276]
    assert got == want, f"rank 0 keeps {got[0]:,} B of state, expected K*S = {want[0]:,}: a view?"

@pytest.mark.exercise("9.5", points=1)
def test_no_message():
    assert [4368, 1] == [3276, 1]
'''


def _run(pytester, *args):
    pytester.makepyfile(test_graded=GRADED)
    return pytester.runpytest_subprocess("-p", "labkit.score_table", "-p", "no:cacheprovider", *args)


def test_grade_table_scores_passed_failed_not_attempted_and_needs_cuda(pytester):
    result = _run(pytester, "--grade", "--grade-json", "out.json")
    table = json.loads((pytester.path / "out.json").read_text())
    ex = table["exercises"]
    assert ex["9.1"]["not attempted"] == 1 and ex["9.1"]["earned"] == 0
    assert ex["9.2"]["earned"] == 2 and ex["9.2"]["possible"] == 3 and ex["9.2"]["failed"] == 1
    assert ex["9.3"]["needs CUDA"] == 1
    # 9.4's 3 points are not graded and 9.3's CUDA point is not run here: both left out
    assert table["labs"]["9"] == {"earned": 2, "possible": 8, "cuda_points": 1, "ungraded_points": 3}
    assert table["possible"] == 8 and table["cuda_points"] == 1
    assert "one plus one is two" in ex["9.2"]["tests"][1]["message"] or \
        "one plus one is two" in ex["9.2"]["tests"][0]["message"]
    result.stdout.fnmatch_lines(["*not attempted*needs CUDA*not graded*", "*9.1*0 / 3*",
                                 "*lab 9*2 / 8*+1 need CUDA*+3 not graded*"])


def test_exercise_option_runs_only_that_exercise(pytester):
    result = _run(pytester, "--exercise", "9.2")
    result.assert_outcomes(passed=1, failed=1, deselected=7)


def test_first_test_only_runs_the_first_graded_test_of_each_exercise(pytester):
    """make test's notebook runs (LABKIT_CHECK_FIRST_TEST): one test of each exercise, the first
    in file order; with --exercise, of that exercise alone."""
    result = _run(pytester, "--first-test-only", "-v")
    result.assert_outcomes(passed=1, failed=2, skipped=2, deselected=4)
    ran = [n for n in ("attempted_nothing", "right", "wrong", "gpu", "missing_reference",
                       "old_reference", "introspection_hidden", "no_message", "not_graded")
           if f"::test_{n} " in result.stdout.str()]
    assert ran == ["attempted_nothing", "right", "gpu", "missing_reference",
                   "introspection_hidden"], ran
    result = _run(pytester, "--first-test-only", "--exercise", "9.2")
    result.assert_outcomes(passed=1, deselected=8)


def test_stubs_must_fail_rejects_a_grader_that_passes(pytester):
    result = _run(pytester, "--stubs-must-fail")
    assert result.ret == 1
    result.stdout.fnmatch_lines(["*PASSED ON A STUB*test_right*"])


def test_stubs_must_fail_accepts_when_every_graded_test_fails(pytester):
    result = _run(pytester, "--stubs-must-fail", "--exercise", "9.1")
    assert result.ret == 0


def test_a_missing_or_too_old_optional_reference_is_not_graded(pytester):
    """A grader whose reference library is missing (or older than required) neither earns nor
    costs points: 'not graded', its points out of the total, its own column in the table."""
    _run(pytester, "--grade", "--grade-json", "out.json", "--exercise", "9.4")
    e = json.loads((pytester.path / "out.json").read_text())["exercises"]["9.4"]
    assert e["not graded"] == 2 and e["failed"] == 0 and e["possible"] == 0 and e["earned"] == 0
    messages = sorted(t["message"] for t in e["tests"])
    assert "no_such_module_for_labkit_tests" in messages[0] and "999.0" in messages[1]


def test_optional_reference_returns_the_module_when_it_is_there():
    from labkit.score_table import optional_reference

    assert optional_reference("json").dumps([1]) == "[1]"
    assert optional_reference("pytest", min_version="1.0") is pytest


def test_failure_messages_are_the_tests_own_words_not_pytest_introspection(pytester):
    """The table and the JSON carry the text after `assert ..., "message"`; pytest's
    `assert [4368] == [3276]` and "Use -v to get more diff" stay in the details."""
    result = _run(pytester, "--grade", "--grade-json", "out.json", "--exercise", "9.5")
    tests = {t["test"]: t for t in
             json.loads((pytester.path / "out.json").read_text())["exercises"]["9.5"]["tests"]}
    own = tests["test_introspection_hidden"]
    assert own["message"] == "rank 0 keeps 4,368 B of state, expected K*S = 3,276: a view?"
    assert "assert [4368] == [3276]" in own["details"]
    assert "Use -v" not in own["message"]
    bare = tests["test_no_message"]["message"]
    assert bare.startswith("assert [4368, 1] == [3276, 1]") and "verbose=True" in bare
    result.stdout.fnmatch_lines(["*what failed*", "*9.5*FAIL test_introspection_hidden",
                                 "*rank 0 keeps 4,368 B of state, expected K*S = 3,276: a view?"])
    assert "Use -v to get more diff" not in result.stdout.str().split("what failed")[1]


def test_assertion_message_of_assert_close_and_of_other_errors():
    import torch

    from labkit.score_table import assertion_message

    try:
        torch.testing.assert_close(torch.ones(2), torch.zeros(2), msg=lambda m: f"exp_avg: {m} (forgot /N?)")
    except AssertionError as exc:
        text = assertion_message(exc)
    assert text.startswith("exp_avg: Tensor-likes are not close!") and text.endswith("(forgot /N?)")
    assert assertion_message(ValueError("bad\nmore")) == "ValueError: bad"
    multi = AssertionError("first line\n  second line\nassert None is None")
    assert assertion_message(multi) == "first line\nsecond line"


UNTOUCHED = GRADED + '''

def stub8():
    raise NotImplementedError("exercise 8.1: write it (labs/08_x.ipynb)")

@pytest.mark.exercise("8.1", points=2)
def test_lab_8_first():
    stub8()

@pytest.mark.exercise("8.2", points=3)
def test_lab_8_second():
    stub8()
'''


def test_a_lab_not_started_is_one_line_and_the_grade_exits_0(pytester):
    """`make grade` on a tree where lab 8 is untouched: lab 8 is one "not started" line (no
    row per exercise, no failure listed), and the run exits 0 since the table is the result."""
    pytester.makepyfile(test_graded=UNTOUCHED)
    result = pytester.runpytest_subprocess("-p", "labkit.score_table", "-p", "no:cacheprovider",
                                           "-rN", "--tb=no", "--grade", "--grade-json", "out.json")
    assert result.ret == 0
    out = result.stdout.str()
    result.stdout.fnmatch_lines(["*lab 8*0 / 5*not started: all 2 exercises are still stubs*"])
    assert not any(line.startswith(("8.1", "8.2")) for line in out.splitlines())
    assert "test_lab_8_first" not in out and "FAILED" not in out
