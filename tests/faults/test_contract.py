"""What an engine or a user function returns is checked against the roles' types before it is
written (asyncflow/runtime/contract.py): a missing output, a row left out, a wrong length, a
non-numeric or non-finite value is a located AF611/AF612 error naming the task and the row."""
import math

import pytest

from asyncflow.runtime.contract import TaskError, check_outputs, problem


class Task:
    name, loc = "gen", "p.yaml:30:3"


OUT = [("completion", "text"), ("lp", "token_floats")]


@pytest.mark.parametrize("cols,code,row", [
    ({"completion": ["a", "b"]}, "AF611", 7),                       # an output omitted
    ({"completion": ["a"], "lp": [[-1.0], [-1.0]]}, "AF611", 7),    # a wrong number of rows
    ({"completion": ["a", None], "lp": [[-1.0], [-1.0]]}, "AF611", 8),  # a row left out
    ({"completion": ["a", 3], "lp": [[-1.0], [-1.0]]}, "AF612", 8),     # not text
    ({"completion": ["a", "b"], "lp": [[-1.0], [math.nan]]}, "AF612", 8),
    ({"completion": ["a", "b"], "lp": [[-1.0], [-math.inf, 0.0]]}, "AF612", 8),
    ({"completion": ["a", "b"], "lp": [[-1.0], ["x"]]}, "AF612", 8),
    ({"completion": ["a", "b"], "lp": [[-1.0], 0.5]}, "AF612", 8),   # a float, not per token
])
def test_bad_outputs_name_the_task_field_and_row(cols, code, row):
    with pytest.raises(TaskError) as ei:
        check_outputs(Task, cols, OUT, [7, 8])
    p = ei.value.payload()
    assert p["code"] == code and p["loc"] == "p.yaml:30:3"
    assert p["fields"]["task"] == "gen" and p["fields"]["row"] == row


def test_good_outputs_pass_and_types_say_what_fits():
    check_outputs(Task, {"completion": ["a", "b"], "lp": [[-1.0], [-0.5, -2]]}, OUT, [0, 1])
    assert problem(1.0, "float") is None and problem(True, "float") is None
    assert problem(float("nan"), "float") and problem("1", "float")
    assert problem([0.1, 0.2], "adv") is None and problem(0.3, "adv") is None
    assert problem(object(), "any") is None and problem(None, "data") is None
    assert problem(True, "flag") is None and problem("yes", "flag")
