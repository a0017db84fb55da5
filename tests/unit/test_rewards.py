"""The built-in math and format rewards against answers worked out by hand."""

from __future__ import annotations

from fractions import Fraction

import pytest

from temper.objectives.rewards import (
    boxed_answer,
    boxed_format,
    boxed_match,
    final_number,
    final_number_match,
    get_reward,
)


def test_boxed_answer_takes_the_last_box_with_nested_braces() -> None:
    assert boxed_answer(r"first \boxed{1}, then \boxed{\frac{1}{2}} done") == r"\frac{1}{2}"
    assert boxed_answer(r"\boxed{unclosed {") is None
    assert boxed_answer("no box") is None


@pytest.mark.parametrize(
    ("completion", "answer", "want"),
    [
        (r"so x = \boxed{42}.", "42", 1.0),
        (r"\boxed{ 0.50 }", "1/2", 1.0),  # equal as numbers
        (r"\boxed{1,000}", "1000", 1.0),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}", 1.0),  # equal as text
        (r"\boxed{41}", "42", 0.0),
        ("42", "42", 0.0),  # no box
    ],
)
def test_boxed_match(completion: str, answer: str, want: float) -> None:
    assert boxed_match("", completion, {"answer": answer}) == want


def test_final_number_match_reads_the_last_number() -> None:
    assert final_number("12 apples, 3 left: #### -1,234.5") == Fraction("-1234.5")
    assert final_number("none") is None
    record = {"answer": "18", "question_id": 7}
    assert final_number_match("", "She earns 9 * 2 = 18 dollars.\n#### 18", record) == 1.0
    assert final_number_match("", "18 dollars, or 19", record) == 0.0
    assert final_number_match("", "no number", record) == 0.0


def test_boxed_format_wants_exactly_one_closed_box() -> None:
    assert boxed_format("", r"work... \boxed{3}", {}) == 1.0
    assert boxed_format("", r"\boxed{3} or \boxed{4}", {}) == 0.0
    assert boxed_format("", r"\boxed{3", {}) == 0.0
    assert get_reward("boxed_format") is boxed_format
