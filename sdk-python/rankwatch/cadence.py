"""When each probe measures: `Cadence`, the steps between measurements per probe, and
`ProbeSchedule`, which of them are due around a logged step.

Cadence is keyed to the steps the user logs, whatever their spacing: a probe due at any step in
(s, s + Δ], Δ the last gap between logged steps, is armed after `log(s)` and reported with the
next logged step, and what it reports describes that step (the last optimizer step's gradient;
the activations of that step's forward passes). A probe that measures when `log` is called
(the spectral probe, the replica fingerprint) is due when a multiple of its cadence lies in
(previous logged step, this step].
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields


@dataclass
class Cadence:
    """Steps between measurements, per probe (1 = every step). `0` turns a probe off."""

    grad: int = 1
    sketch: int = 10
    dot: int = 10
    activations: int = 25
    spectral: int = 50
    fingerprint: int = 10

    @classmethod
    def parse(cls, every: int | Mapping[str, int] | Cadence | None) -> Cadence:
        if every is None:
            return cls()
        if isinstance(every, Cadence):
            return every
        if isinstance(every, bool) or not isinstance(every, (int, Mapping)):
            raise TypeError(f"rankwatch.init: every= takes an int, a dict of probe→steps or a Cadence, got {type(every).__name__}")
        if isinstance(every, int):
            if every < 1:
                raise ValueError(f"rankwatch.init: every= must be at least 1, got {every}")
            # One number sets the cadence of the expensive probes; the cheap ones stay per step.
            return cls(activations=every, spectral=every, sketch=every, dot=every, fingerprint=every)
        unknown = set(every) - set(PROBES)
        if unknown:
            raise ValueError(f"rankwatch.init: unknown probe(s) in every=: {sorted(unknown)}; known: {sorted(PROBES)}")
        for k, v in every.items():
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"rankwatch.init: every[{k!r}] must be an int >= 0, got {v!r}")
        return cls(**dict(every))

    @staticmethod
    def due_within(every: int, after: int, upto: int) -> bool:
        """Whether a step s with s % every == 0 lies in (after, upto]."""
        return every > 0 and upto // every > after // every


# The probes a cadence names, in its order (what `every=` and `--every` accept).
PROBES: tuple[str, ...] = tuple(f.name for f in fields(Cadence))


@dataclass(frozen=True)
class Window:
    """The steps around one logged step: the one logged before it and the one expected next."""

    previous: int  # the last logged step (the step before, at the first log)
    step: int
    upto: int  # the next logged step, expected one gap on

    def now(self, every: int) -> bool:
        """Due at this step: a multiple of `every` in (previous, step]."""
        return Cadence.due_within(every, self.previous, self.step)

    def next(self, every: int) -> bool:
        """Due by the next logged step: a multiple of `every` in (step, upto]; arm it now."""
        return Cadence.due_within(every, self.step, self.upto)


class ProbeSchedule:
    """Follows the logged steps and their spacing."""

    def __init__(self) -> None:
        self.last_step: int | None = None
        self._gap = 1

    def window(self, step: int) -> Window:
        """The window of a step being logged (before `logged(step)`)."""
        if self.last_step is not None and step > self.last_step:
            self._gap = step - self.last_step
        previous = self.last_step if self.last_step is not None else step - 1
        return Window(previous, step, step + self._gap)

    def logged(self, step: int) -> None:
        self.last_step = step
