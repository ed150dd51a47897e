"""Every rank of a job switches its probes on (or off) at the same optimizer step.

A switch reaches the ranks of a job at different moments: each rank polls the collector's
probe switch on its own clock, and `rankwatch attach --pid` injects one process after another.
Switching where each rank happens to hear of it is wrong in two ways. The probes that issue a
collective of their own (the gradient probe's one all-reduce per backward under FSDP2, the
spectral probe's over a DTensor mesh) must start and stop at the same step on every rank, or one
rank's collective pairs with another rank's training collective: a hang, or a gradient silently
reduced with the wrong tensor. And the cross-rank statistics need every rank's first watched
step to be the same step.

The ranks agree through the job's own rendezvous store (the key-value store torch.distributed
was initialised with), never through a collective, so the job's collective stream is exactly
what it would be unwatched. Switch number n (every rank has made the same n - 1 switches),
attempt k:

1. A rank with a pending request at the end of its step s proposes step A = s + lead with the
   target state, by a compare-and-set on `n.k/at`: the first proposal wins, the others read it.
   The lead covers the time the other ranks need to hear of the request, converted to steps
   with this rank's step time: the collector poll interval and a second for the collector's
   switch; nothing beyond the minimum for `attach --pid`, whose request every rank reads at
   its own step end once the last rank is injected (a go file), so within a step of the others.
2. At the end of step A - 1, a rank that knows the proposal and wants the same state writes its
   acknowledgement `n.k/ack/<rank>`.
3. At the end of step A, every rank that knows the proposal checks, without waiting, whether all
   acknowledgements exist. Either all switch there, or none does and attempt k + 1 begins with
   twice the lead. A rank that learns of attempt k only after step A - 1 moves on to k + 1.

Step 3 gives every rank the same answer because the training's own collectives order the
steps: a rank cannot end step A before every rank has ended step A - 1 (step A's gradient
reduction needs all of them), so every acknowledgement that will ever be written for attempt k
is already in the store when the first rank checks. The steps must be numbered alike on every
rank: the launched agent counts optimizer steps from the job's first; an injected one takes the
optimizer's own step count (Adam's), and without one switches alone, as before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

PREFIX = "rankwatch/switch/"
MIN_LEAD_STEPS = 3  # the proposer's next step, a rank already one step further, one to spare
MAX_ATTEMPTS = 6  # each twice the lead of the one before: 63 leads in all before giving up


@dataclass(frozen=True)
class Proposal:
    switch: int
    attempt: int
    at: int  # the step at whose end every rank switches
    on: bool  # the state they switch to

    @property
    def key(self) -> str:
        return f"{self.switch}.{self.attempt}"


class Agreement:
    """Proposals, acknowledgements and their check, in a key-value store shared by the ranks."""

    def __init__(self, store: Any, rank: int, world: int, lead_seconds: float) -> None:
        self.store = store
        self.rank = rank
        self.world = world
        self.lead_seconds = lead_seconds

    @classmethod
    def of_job(cls, lead_seconds: float) -> Agreement | None:
        """Through the default process group's store; None for a single process or when there
        is no process group (yet) or no store to reach."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return None
        world = dist.get_world_size()
        if world <= 1:
            return None
        try:
            from torch.distributed import distributed_c10d

            store = distributed_c10d.PrefixStore(PREFIX, distributed_c10d._get_default_store())
        except Exception:  # noqa: BLE001 - a torch without it, or a group made without a store
            return None
        return cls(store, dist.get_rank(), world, lead_seconds)

    def switches_done(self) -> int:
        """Switches made so far by every rank: what a newly injected agent starts from."""
        return int(self.store.get("done")) if self.store.check(["done"]) else 0

    def propose(self, switch: int, attempt: int, step: int, on: bool, step_seconds: float | None, lead_seconds: float | None = None) -> Proposal:
        """This rank's proposal for `switch`, or the one made first; skips the attempts already
        decided without this rank (their step is past). `lead_seconds` overrides the
        agreement's own lead for this request."""
        seconds = self.lead_seconds if lead_seconds is None else lead_seconds
        while True:
            # Doubling per attempt, from one lead again after a request given up on.
            growth = 2 ** ((attempt - 1) % MAX_ATTEMPTS)
            lead = MIN_LEAD_STEPS * growth
            if step_seconds:
                lead = max(lead, math.ceil(seconds * growth / step_seconds))
            mine = f"{step + lead}:{int(on)}"
            got = self.store.compare_set(f"{switch}.{attempt}/at", "", mine).decode()
            at, target = got.split(":")
            proposal = Proposal(switch, attempt, int(at), target == "1")
            if proposal.at - 1 >= step:
                return proposal
            attempt += 1

    def acknowledge(self, proposal: Proposal) -> None:
        self.store.set(f"{proposal.key}/ack/{self.rank}", "1")

    def complete(self, proposal: Proposal) -> bool:
        return bool(self.store.check([f"{proposal.key}/ack/{r}" for r in range(self.world)]))

    def missing(self, proposal: Proposal, most: int = 16) -> list[int]:
        """The ranks that did not acknowledge (the first `most`), for the message."""
        out = []
        for r in range(self.world):
            if not self.store.check([f"{proposal.key}/ack/{r}"]):
                out.append(r)
                if len(out) == most:
                    break
        return out

    def done(self, proposal: Proposal) -> None:
        self.store.set("done", str(proposal.switch))


class Switch:
    """One rank's side of the agreement: holds what this rank was asked and, called at the end
    of every optimizer step, says when to switch."""

    def __init__(self, agreement: Agreement | None) -> None:
        self.agreement = agreement
        self.switches = agreement.switches_done() if agreement is not None else 0
        self.wanted: bool | None = None  # the pending request: on (True), off (False), none
        self.lead_seconds: float | None = None  # the pending request's own lead (None: the agreement's)
        self.attempt = 1
        self.proposal: Proposal | None = None
        self.acknowledged = False
        self.gave_up: str | None = None  # the message, when an agreement failed for good

    def end_of_step(self, step: int, current: bool, step_seconds: float | None) -> bool | None:
        """The state to switch to at the end of this step, or None; `current` is whether this
        rank's probes are on. A proposal this rank acknowledged binds it: the others switch at
        that step whatever it has heard since."""
        self.gave_up = None
        target = self._decide(step, current, step_seconds)
        if self.wanted is not None and self.wanted == (current if target is None else target):
            self.wanted = None  # done, or nothing to do
        return target

    def _decide(self, step: int, current: bool, step_seconds: float | None) -> bool | None:
        agreement, wanted = self.agreement, self.wanted
        if agreement is None:
            return wanted if wanted is not None and wanted != current else None
        if self.proposal is None:
            if wanted is None or wanted == current:
                return None
            self.switches = max(self.switches, agreement.switches_done())
            self.proposal = agreement.propose(self.switches + 1, self.attempt, step, wanted, step_seconds, self.lead_seconds)
            self.acknowledged = False
        proposal = self.proposal
        if step == proposal.at - 1 and proposal.on == wanted and proposal.on != current:
            agreement.acknowledge(proposal)
            self.acknowledged = True
        if step < proposal.at:
            return None
        # The end of step A: every rank that knows the proposal decides the same here.
        self.proposal = None
        if self.acknowledged and agreement.complete(proposal):
            self.switches, self.attempt = proposal.switch, 1
            agreement.done(proposal)
            return proposal.on
        self.attempt = proposal.attempt + 1
        if self.attempt % MAX_ATTEMPTS == 1:
            self.wanted = None
            state = "on" if proposal.on else "off"
            self.gave_up = (
                f"the ranks did not agree on a step to switch the probes {state} (last tried: step {proposal.at}; "
                f"no answer from rank(s) {agreement.missing(proposal)}); the request is dropped"
            )
        return None
