"""The probe schedule: which probes are due around a logged step, whatever the spacing of the
steps the script logs (`rankwatch/cadence.py`)."""

from __future__ import annotations

import pytest

from rankwatch.cadence import PROBES, Cadence, ProbeSchedule


def test_the_first_window_covers_the_step_itself_and_the_next_one() -> None:
    window = ProbeSchedule().window(0)
    assert (window.previous, window.step, window.upto) == (-1, 0, 1)
    assert window.now(50)  # step 0 is a multiple of every cadence: measured at the first log
    assert window.next(1) and not window.next(10)


def test_a_probe_is_armed_for_the_next_logged_step_when_the_script_logs_every_tenth() -> None:
    schedule = ProbeSchedule()
    armed, measured = [], []
    for step in range(0, 200, 10):
        window = schedule.window(step)
        if window.next(25):
            armed.append(step)  # a step in (step, step + 10] is a multiple of 25
        if window.now(25):
            measured.append(step)  # a multiple of 25 in (last logged, step]
        schedule.logged(step)
    # 25 lies in (20, 30], 50 in (40, 50], ...: armed one logged step before, never missed.
    assert armed == [20, 40, 70, 90, 120, 140, 170, 190]
    assert measured == [0, 30, 50, 80, 100, 130, 150, 180]


def test_the_gap_follows_the_last_spacing_and_ignores_a_repeated_step() -> None:
    schedule = ProbeSchedule()
    for step in (0, 4, 8):
        schedule.window(step)
        schedule.logged(step)
    assert schedule.window(8).upto == 12  # a step logged twice keeps the last gap
    schedule.logged(8)
    assert schedule.window(20).upto == 32


def test_every_probe_name_parses_and_an_unknown_one_is_refused_by_name() -> None:
    assert Cadence.parse({name: 3 for name in PROBES}) == Cadence(*(3 for _ in PROBES))
    assert Cadence.parse(7) == Cadence(grad=1, sketch=7, dot=7, activations=7, spectral=7, fingerprint=7)
    with pytest.raises(ValueError, match="unknown probe.*'spectra'"):
        Cadence.parse({"spectra": 3})
    with pytest.raises(ValueError, match="must be an int >= 0"):
        Cadence.parse({"grad": -1})
