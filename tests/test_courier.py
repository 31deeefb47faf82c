"""The Ray host's courier (asyncflow/runtime/courier.py): a trainer's publish notice, step ack and
report go out in the order given, on a thread of their own; a failure is raised in the loop,
never lost."""
import threading
import time

import pytest

from asyncflow.runtime.courier import Courier


def test_calls_are_made_in_order_and_drain_waits_for_them():
    done, gate = [], threading.Event()

    def slow(x):
        gate.wait(5)
        done.append(x)

    c = Courier("t")
    c.send(slow, 1)
    c.send(done.append, 2)
    c.send(done.append, 3)
    assert done == []  # the sender did not wait for the first call
    gate.set()
    c.drain()
    assert done == [1, 2, 3]


def test_a_failed_call_is_raised_at_the_next_check_and_the_rest_are_not_made():
    made = []

    def boom():
        raise RuntimeError("the store is gone")

    c = Courier("t")
    c.send(boom)
    c.send(made.append, "after")
    with pytest.raises(RuntimeError, match="the store is gone"):
        c.drain()
    assert made == []  # what came after a failure was not made
    c.check()  # raised once
    c.send(made.append, "later")
    c.drain()
    assert made == ["later"]


def test_send_raises_an_earlier_failure_first():
    c = Courier("t")
    c.send(lambda: 1 / 0)
    deadline = time.time() + 5
    while c._error is None and time.time() < deadline:
        time.sleep(0.01)
    with pytest.raises(ZeroDivisionError):
        c.send(print, "never")
