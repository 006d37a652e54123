"""The grading plugin: a fair table that a stub cannot game and that names what was not attempted."""
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
'''


def _run(pytester, *args):
    pytester.makepyfile(test_graded=GRADED)
    return pytester.runpytest_subprocess("-p", "labkit.grading", "-p", "no:cacheprovider", *args)


def test_grade_table_scores_passed_failed_not_attempted_and_needs_cuda(pytester):
    result = _run(pytester, "--grade", "--grade-json", "out.json")
    table = json.loads((pytester.path / "out.json").read_text())
    ex = table["exercises"]
    assert ex["9.1"]["not attempted"] == 1 and ex["9.1"]["earned"] == 0
    assert ex["9.2"]["earned"] == 2 and ex["9.2"]["possible"] == 3 and ex["9.2"]["failed"] == 1
    assert ex["9.3"]["needs CUDA"] == 1
    assert table["labs"]["9"] == {"earned": 2, "possible": 7}
    assert "one plus one is two" in ex["9.2"]["tests"][1]["message"] or \
        "one plus one is two" in ex["9.2"]["tests"][0]["message"]
    result.stdout.fnmatch_lines(["*9.1*0 / 3*", "*lab 9*2 / 7*"])


def test_exercise_option_runs_only_that_exercise(pytester):
    result = _run(pytester, "--exercise", "9.2")
    result.assert_outcomes(passed=1, failed=1, deselected=3)


def test_stubs_must_fail_rejects_a_grader_that_passes(pytester):
    result = _run(pytester, "--stubs-must-fail")
    assert result.ret == 1
    result.stdout.fnmatch_lines(["*PASSED ON A STUB*test_right*"])


def test_stubs_must_fail_accepts_when_every_graded_test_fails(pytester):
    result = _run(pytester, "--stubs-must-fail", "--exercise", "9.1")
    assert result.ret == 0


def test_check_reports_an_unknown_exercise(monkeypatch):
    import labkit

    with pytest.raises(ValueError, match="known exercises"):
        labkit.check("99.99")
