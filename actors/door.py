"""DoorLimits: what the frontend admits, from the limits every registered worker sent.

The door checks the limits of every registered worker, of every role, and so admits only
what the tightest of them takes: a request let in fits every instance it could be sent to.
Workers of one role given different ``[model.limits]`` therefore admit what all of them
take, never what the most recently registered one happens to take. (A worker with tighter
limits may join after a request was let in: the pools send such a request only to workers
that take it, actors/pools.py.)
"""

from __future__ import annotations

from orchestrator.limits import limits_violation
from transfer.protocol import ROLES, GenParams, Role, StageLimits


class DoorLimits:
    def __init__(self) -> None:
        self._live: dict[Role, dict[str, StageLimits]] = {}  # role -> instance -> its limits
        # A role whose last worker left keeps that worker's limits until another registers:
        # a restart is the usual reason, and its replacement runs the same config. Requests
        # admitted meanwhile wait in the role's queue for it.
        self._departed: dict[Role, StageLimits] = {}
        self._checked: tuple[StageLimits, ...] = ()  # distinct: one check per distinct config

    def joined(self, role: Role, instance: str, limits: StageLimits) -> None:
        if not any(self._live.values()):
            # The first worker after none at all may bring another model (the daemon takes
            # one while no worker is registered): the departed ones' limits say nothing now.
            self._departed.clear()
        self._live.setdefault(role, {})[instance] = limits
        self._departed.pop(role, None)
        self._recount()

    def left(self, role: Role, instance: str) -> None:
        live = self._live.get(role, {})
        limits = live.pop(instance, None)
        if limits is not None and not live:
            self._departed[role] = limits
        self._recount()

    def unserved(self) -> list[Role]:
        """The roles no registered worker serves now."""
        return [role for role in ROLES if not self._live.get(role)]

    def violation(self, params: GenParams) -> str | None:
        """The first way ``params`` break a registered worker's limits, or None."""
        for limits in self._checked:
            problem = limits_violation(limits, params)
            if problem:
                return problem
        return None

    def _recount(self) -> None:
        every = [*self._departed.values(), *(limits for live in self._live.values() for limits in live.values())]
        self._checked = tuple(dict.fromkeys(every))
