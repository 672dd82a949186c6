"""`thinkspec demo` on the bundled toy pair, at a reduced size."""

from __future__ import annotations

from thinkspec.entrypoints.cli import main


def test_demo_prints_both_modes_and_an_example(capsys):
    assert main(["demo", "--num-problems", "2", "--device", "cpu", "--seed", "7"]) == 0
    out = capsys.readouterr().out
    assert "strict" in out and "relaxed (ratio" in out
    assert "--- reasoning_content ---" in out and "--- content ---" in out
    assert "**Answer:**" in out  # the answer part, shown apart from the reasoning
    table = [line for line in out.splitlines() if line.startswith(("strict", "relaxed"))]
    assert len(table) == 2
    for line in table:
        accuracy = line.split()[-4] if line.startswith("strict") else line.split()[-4]
        correct, total = accuracy.split("/")
        assert total == "2" and 0 <= int(correct) <= 2
