"""labkit.bench: the timing behind `make bench` and the chapters' speed tables (not graded)."""
from __future__ import annotations

import pytest

from labkit.bench import Case, bench_table, cpu_seconds, time_case


def _spin(n):
    def run():
        total = 0
        for i in range(n):
            total += i
        return total
    return run


def test_time_case_interleaves_and_reports_cpu_and_wall_medians():
    calls = []
    case = Case(0, "spin", lambda: calls.append("ours") or _spin(20000)(),
                lambda: calls.append("ref") or _spin(10000)(), "half the spin", repeat=5)
    row = time_case(case)
    assert calls == ["ours", "ref"] * 6, "one warm-up each, then interleaved rounds"
    assert row["repeat"] == 5 and row["label"] == "spin" and row["reference"] == "half the spin"
    assert row["ours_s"] > 0 and row["ref_s"] > 0 and row["ours_wall_s"] > 0
    assert row["ratio"] == pytest.approx(row["ours_s"] / row["ref_s"])
    assert 1.2 < row["ratio"] < 4, row  # twice the loop: about twice the CPU time


def test_bench_table_renders_one_line_per_case():
    text, rows = bench_table([Case(0, "a", _spin(100), _spin(100), "b", repeat=2)] * 2, repeat=3)
    assert len(rows) == 2 and all(r["repeat"] == 3 for r in rows)
    assert text.count("\n") == 3 and "ratio (CPU)" in text


def test_cpu_seconds_counts_this_process():
    start = cpu_seconds()
    _spin(200000)()
    assert cpu_seconds() > start


@pytest.mark.parametrize("call, exc, word", [
    (lambda: time_case("not a case"), TypeError, "case"),
    (lambda: time_case(Case(0, "x", 3, _spin(1), "y")), TypeError, "ours"),
    (lambda: time_case(Case(0, "x", _spin(1), _spin(1), "y"), repeat=0), ValueError, "repeat"),
    (lambda: bench_table(Case(0, "x", _spin(1), _spin(1), "y")), TypeError, "cases"),
])
def test_bench_refuses_bad_input(call, exc, word):
    with pytest.raises(exc, match=word):
        call()


def test_html_table_escapes_and_has_one_row_per_case():
    from labkit.bench import html_table

    row = {"label": "a<b", "ours_s": 0.002, "reference": "F.gelu(approximate='tanh')",
           "ref_s": 0.001, "ratio": 2.0, "wall_ratio": 2.1}
    text = html_table([row, row], "timed")
    assert text.count("<tr>") == 3 and "a&lt;b" in text and "timed (ms CPU)" in text
    assert "<td>2.00</td>" in text


def test_tables_leave_the_wall_ratio_out_on_request():
    from labkit.bench import html_table, markdown_table

    row = {"label": "x", "ours_s": 0.002, "reference": "y", "ref_s": 0.001, "ratio": 2.0,
           "wall_ratio": 7.0}
    assert "ratio (wall)" in markdown_table([row]) and "7.00" in markdown_table([row])
    assert "wall" not in markdown_table([row], wall=False) + html_table([row], wall=False)


@pytest.mark.parametrize("target", [0, -1.0, True, "1.5"])
def test_case_refuses_a_target_that_is_not_a_positive_ratio(target):
    with pytest.raises(ValueError, match="target"):
        Case(0, "x", _spin(1), _spin(1), "y", target=target)


def test_make_bench_marks_only_targeted_rows_above_their_target(tmp_path, monkeypatch, capsys):
    """The runner: a context row (target None) is never above target, a targeted row is when its
    ratio passes its own bound, and --strict turns that into exit status 1."""
    import sys
    import types

    from tools.bench import __main__ as runner

    slow, fast = _spin(40000), _spin(4000)  # about 10x: above any bound below
    module = types.ModuleType("tools.bench.lab99")
    module.cases = lambda: [Case(99, "context row", slow, fast, "fast", repeat=3, target=None),
                            Case(99, "targeted row", slow, fast, "fast", repeat=3, target=2.0),
                            Case(99, "within", fast, fast, "same", repeat=3, target=4.0)]
    monkeypatch.setitem(sys.modules, "tools.bench.lab99", module)
    monkeypatch.setattr(runner, "available_labs", lambda: [99])
    assert runner.main(["--lab", "99", "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    lines = {line.split("  ")[1].strip(): line for line in out.splitlines() if line.startswith("lab 99")}
    assert "ABOVE TARGET" not in lines["context row"] and "context" in lines["context row"]
    assert "ABOVE TARGET" in lines["targeted row"] and "≤ 2" in lines["targeted row"]
    assert "ABOVE TARGET" not in lines["within"]
    assert "1 of 2 targeted rows within their target; 1 context rows" in out
    table = (tmp_path / "out" / "bench.md").read_text()
    assert "| context |" in table and "| ≤ 2 |" in table
    assert runner.main(["--lab", "99", "--out", str(tmp_path / "out"), "--strict"]) == 1
