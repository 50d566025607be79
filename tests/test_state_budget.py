"""StateBudget: the bound on what streams' growing state holds at once, and its automatic size."""

from __future__ import annotations

import threading

import pytest
from servers import wait_until

from service.engine.memory import AUTO_FLOOR, AUTO_SHARE, StateBudget, auto_budget

WAIT_S = 10.0  # how long a test waits for another thread to reach a state (never reached early by a fast machine)


def test_reservations_within_the_limit_go_through_and_are_given_back() -> None:
    budget = StateBudget(100)
    a, b = object(), object()
    assert budget.reserve(a, 60) and budget.reserve(b, 40) and budget.reserve(a, 0)
    assert (budget.used, budget.held(a), budget.held(b), budget.peak) == (100, 60, 40, 100)
    budget.release(a)
    budget.release(a)  # twice: nothing more to give back
    assert (budget.used, budget.held(a)) == (40, 0)


def test_the_oldest_holder_always_goes_on_and_a_newer_one_waits_for_it() -> None:
    budget = StateBudget(100)
    old, new = object(), object()
    assert budget.reserve(old, 90)
    done = threading.Event()

    def newcomer() -> None:
        budget.reserve(new, 30)
        done.set()

    thread = threading.Thread(target=newcomer)
    thread.start()
    wait_until(lambda: budget.waiting == 1, WAIT_S, "the newcomer to wait", 0.002)
    assert budget.reserve(old, 50)  # over the limit, but the oldest: no wait (no circle of waiting streams)
    assert not done.is_set() and budget.used == 140
    budget.release(old)
    thread.join(WAIT_S)
    assert done.is_set() and budget.used == 30 and budget.waiting == 0


def test_a_waiting_reservation_ends_when_its_request_is_cancelled() -> None:
    budget = StateBudget(10)
    holder, waiter = object(), object()
    budget.reserve(holder, 10)
    cancel = threading.Event()
    result: list[bool] = []
    thread = threading.Thread(target=lambda: result.append(budget.reserve(waiter, 5, cancel.is_set)))
    thread.start()
    wait_until(lambda: budget.waiting == 1, WAIT_S, "the reservation to wait", 0.002)
    cancel.set()
    thread.join(WAIT_S)
    assert result == [False] and budget.held(waiter) == 0 and budget.used == 10 and budget.waiting == 0


def test_no_limit_never_waits_and_a_negative_one_is_refused() -> None:
    budget = StateBudget(None)
    assert budget.reserve(object(), 1 << 40) and budget.waiting == 0
    with pytest.raises(ValueError, match="limit"):
        StateBudget(-1)


def test_the_automatic_budget_is_a_share_of_what_the_model_leaves() -> None:
    gib = 1 << 30
    assert auto_budget(4 * gib, 1 * gib) == int(AUTO_SHARE * 3 * gib)
    assert auto_budget(gib, gib) == AUTO_FLOOR  # a limit the model already fills still lets one short sentence run
    assert auto_budget() is None or auto_budget() >= AUTO_FLOOR  # this machine's own limit, whatever it is
