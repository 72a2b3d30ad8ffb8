"""The calculator bounds the cost of every step before it runs.

Before: `**` and the result's digits were bounded, but `round(1,-10**99)` (16 characters)
computed 10**10**99: it never returned and, holding the interpreter lock, froze every
thread of the rollout actor (the tool's timeout could not fire; a retry replayed it).
The expressions run in a child process with a deadline, so that on the old code this
test fails instead of hanging the suite.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ratchet.tools.calculator import Calculator

# expression -> what the model reads
CASES = {
    "round(1,-10**99)": "error: round: ndigits must be between -100 and 100",  # the one found
    "round(7, -10**50)": "error: round: ndigits must be between -100 and 100",
    "round(1.5,10**99)": "error: round: ndigits must be between -100 and 100",
    "round(123456, -3)": "123000",
    "round(2.675, 2)": "2.67",
    "(10**99)**1000": "error: result has more than 100 digits",  # refused from the bit lengths, not computed
    "(2**300)**(2**9)": "error: result has more than 100 digits",
    "2**1000**1000": "error: result has more than 100 digits",
    "(-8)**0.5": "error: result is not a real number",  # complex before
    "sqrt(10**99)": "3.16227766017e+49",
    "sqrt(-1)": "error: sqrt: math domain error",
    "max(10**99, 10**99 * 10)": "error: result has more than 100 digits",
}

_CHILD = """
import json, sys
from ratchet.tools.base import run_tool
from ratchet.tools.calculator import Calculator
calc = Calculator()
print(json.dumps({e: run_tool(calc, {"expression": e}).text for e in json.loads(sys.argv[1])}))
"""


def test_every_step_is_bounded_before_it_runs():
    child = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(list(CASES))], capture_output=True, text=True, timeout=60)
    assert child.returncode == 0, child.stderr
    assert json.loads(child.stdout) == CASES


@pytest.mark.parametrize("key, value", [("max_digits", 10**6), ("max_length", 10**6), ("max_exponent", 10**9)])
def test_the_bounds_themselves_are_capped(key, value):
    with pytest.raises(ValueError, match=f"tools.calculator.config.{key}: at most"):
        Calculator({key: value})
