"""The ranks' agreement on the step to switch at (rankwatch/auto/agreement.py), driven as the
training's collectives drive it: in each step every rank ends the step (in any order) before any
rank ends the next one. Requests reach the ranks at arbitrary steps, or not at all, and may
contradict each other. Whatever happens, after every step all ranks are in the same state; when
every rank hears a request within the lead, they switch within a few leads."""

from __future__ import annotations

import random

import pytest
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from rankwatch.auto.agreement import MAX_ATTEMPTS, MIN_LEAD_STEPS, PREFIX, Agreement, Switch

STEP_SECONDS = 0.1
LEAD_SECONDS = 0.5  # 5 steps at 0.1 s a step


class Job:
    def __init__(self, world: int) -> None:
        store = dist.HashStore()
        self.switches = [Switch(Agreement(dist.PrefixStore(PREFIX, store), r, world, LEAD_SECONDS)) for r in range(world)]
        self.on = [False] * world
        self.changes: list[list[tuple[int, bool]]] = [[] for _ in range(world)]
        self.gave_up: list[str] = []

    def step(self, step: int, order: list[int], requests: dict[int, bool]) -> None:
        for rank in order:
            switch = self.switches[rank]
            if rank in requests:
                switch.wanted = requests[rank]
            target = switch.end_of_step(step, self.on[rank], STEP_SECONDS)
            if switch.gave_up:
                self.gave_up.append(switch.gave_up)
            if target is not None:
                assert target != self.on[rank], "a switch to the state a rank is already in"
                self.on[rank] = target
                self.changes[rank].append((step, target))


requests_strategy = st.lists(
    st.tuples(st.integers(0, 3), st.integers(1, 120), st.booleans()),  # rank, step it arrives before, on/off
    max_size=12,
)


@settings(max_examples=300, deadline=None)
@given(world=st.integers(2, 4), requests=requests_strategy, seed=st.integers(0, 2**32 - 1))
def test_every_rank_is_always_in_the_same_state(world: int, requests: list[tuple[int, int, bool]], seed: int) -> None:
    order_rng = random.Random(seed)
    job = Job(world)
    for step in range(1, 400):
        arriving = {rank: on for rank, at, on in requests if at == step and rank < world}
        order = list(range(world))
        order_rng.shuffle(order)
        job.step(step, order, arriving)
        assert len(set(job.on)) == 1, f"ranks disagree after step {step}: {job.on}"
    assert all(c == job.changes[0] for c in job.changes), job.changes


@settings(max_examples=100, deadline=None)
@given(world=st.integers(2, 8), first=st.integers(1, 50), spread=st.integers(0, 4), seed=st.integers(0, 2**32 - 1))
def test_a_request_every_rank_hears_within_the_lead_switches_them_together(world: int, first: int, spread: int, seed: int) -> None:
    rng = random.Random(seed)
    heard = {rank: first + rng.randint(0, spread) for rank in range(world)}  # within 5 steps of the first
    job = Job(world)
    for step in range(1, 200):
        order = list(range(world))
        rng.shuffle(order)
        job.step(step, order, {r: True for r, at in heard.items() if at == step})
    assert job.on == [True] * world
    (switched_at, _), *rest = job.changes[0]
    assert not rest
    lead = round(LEAD_SECONDS / STEP_SECONDS)
    # The first rank to hear proposes its step + lead; that attempt holds: every rank heard in time.
    assert switched_at == min(heard.values()) + lead, (switched_at, heard)


def test_a_rank_that_hears_late_makes_the_first_attempt_fail_and_the_next_one_hold() -> None:
    job = Job(2)
    lead = round(LEAD_SECONDS / STEP_SECONDS)
    for step in range(1, 60):
        requests = {0: True} if step == 10 else {1: True} if step == 10 + lead + 2 else {}
        job.step(step, [0, 1], requests)
        assert job.on[0] == job.on[1]
    # Attempt 1 fails at step 10 + lead; rank 0 proposes attempt 2 at the next step, with twice
    # the lead, and rank 1, hearing at 10 + lead + 2, skips attempt 1 and joins it.
    assert job.changes[0] == job.changes[1] == [(10 + lead + 1 + 2 * lead, True)]


def test_a_rank_that_never_hears_leaves_the_others_as_they_are_and_the_request_is_dropped_with_a_message() -> None:
    job = Job(3)
    for step in range(1, 2000):
        job.step(step, [2, 0, 1], {0: True, 1: True} if step == 5 else {})
    assert job.on == [False, False, False]
    assert len(job.gave_up) == 2 and all("no answer from rank(s) [2]" in m and "switch the probes on" in m for m in job.gave_up)
    assert job.switches[0].wanted is None, "the request is dropped"
    # Then a request all hear goes through as switch 1.
    for step in range(2000, 2100):
        job.step(step, [0, 1, 2], {0: True, 1: True, 2: True} if step == 2000 else {})
    assert job.on == [True, True, True]
    assert job.changes[0] == [(2000 + max(MIN_LEAD_STEPS, round(LEAD_SECONDS / STEP_SECONDS)), True)]
    assert MAX_ATTEMPTS >= 3


def test_an_agent_that_joins_later_reads_how_many_switches_were_made() -> None:
    store = dist.HashStore()
    job = Job(2)
    job.switches = [Switch(Agreement(dist.PrefixStore(PREFIX, store), r, 2, LEAD_SECONDS)) for r in range(2)]
    for step in range(1, 30):
        job.step(step, [1, 0], {0: True, 1: True} if step == 3 else {})
    assert job.on == [True, True]
    late = Switch(Agreement(dist.PrefixStore(PREFIX, store), 1, 2, LEAD_SECONDS))
    assert late.switches == 1


def test_no_process_group_means_switching_alone_at_once() -> None:
    if dist.is_initialized():
        pytest.skip("a process group is open in this process")
    assert Agreement.of_job(1.0) is None
    switch = Switch(None)
    switch.wanted = True
    assert switch.end_of_step(7, False, None) is True
    assert switch.wanted is None


@settings(max_examples=100, deadline=None)
@given(world=st.integers(2, 8), first=st.integers(1, 50), late=st.sets(st.integers(0, 7)), seed=st.integers(0, 2**32 - 1))
def test_a_request_without_a_lead_of_its_own_switches_a_few_steps_on(world: int, first: int, late: set[int], seed: int) -> None:
    """`attach --pid`'s request: every rank reads the go file at its own step end, within a step
    of the others, so the minimum lead holds however long the collector poll's lead is."""
    rng = random.Random(seed)
    heard = {rank: first + (1 if rank in late else 0) for rank in range(world)}
    job = Job(world)
    for step in range(1, 100):
        order = list(range(world))
        rng.shuffle(order)
        for rank in order:
            if heard[rank] == step:
                job.switches[rank].lead_seconds = 0.0
        job.step(step, order, {r: True for r, at in heard.items() if at == step})
    assert job.on == [True] * world
    assert all(c == [(min(heard.values()) + MIN_LEAD_STEPS, True)] for c in job.changes), job.changes
