"""When a periodic client's next request is due.

A client that waits for each answer and then acts for a while before asking again (a robot
executing an action chunk at its control rate) leaves a steady gap between an answer and its
next request; a robot whose episode just ended asks again at once (after its reset), so a
client's gaps fall in a few groups. Per client (``SamplingParams.client_id``), the forecast keeps
the last ``GAPS`` gaps and each is a candidate (gaps within ``CLUSTER_S`` of each other are one,
the earliest): the next request is due at the last answer's time plus one of them. ``next_due``
is the earliest candidate not yet passed by more than ``late`` seconds: once one passes without
a request, the next one is due. A client whose request is live has no forecast (it is here); one
with every candidate passed has none until it asks again (a robot that stopped costs nothing
for long).
"""

from __future__ import annotations

import collections


class ArrivalForecast:
    GAPS = 6  # gaps kept per client
    CLUSTER_S = 0.010  # gaps this close are one candidate (the earliest of them)

    def __init__(self, max_clients: int = 1024):
        self.max_clients = max_clients
        self._answered: dict[str, float] = {}  # client -> when its last request finished
        self._gaps: dict[str, collections.deque] = {}  # client -> last gaps (answer to next request), s

    def arrived(self, client: str, now: float) -> None:
        last = self._answered.pop(client, None)
        if last is None:
            return
        gaps = self._gaps.pop(client, None) or collections.deque(maxlen=self.GAPS)
        gaps.append(max(0.0, now - last))
        self._gaps[client] = gaps  # re-inserted: the dict's order is last use, oldest first
        while len(self._gaps) > self.max_clients:
            self._gaps.pop(next(iter(self._gaps)))

    def finished(self, client: str, now: float) -> None:
        self._answered.pop(client, None)
        self._answered[client] = now
        while len(self._answered) > self.max_clients:
            self._answered.pop(next(iter(self._answered)))

    def next_due(self, now: float, late: float = 0.0) -> float | None:
        """The earliest forecast arrival at or after ``now - late`` (perf_counter seconds), or None."""
        due = None
        for client, answered in list(self._answered.items()):
            gaps = self._gaps.get(client)
            if not gaps:
                continue
            pending = [answered + g for g in self._candidates(gaps) if answered + g >= now - late]
            if not pending:
                del self._answered[client]  # every candidate passed: not forecast until it asks again
                continue
            due = min(pending) if due is None else min(due, min(pending))
        return due

    def _candidates(self, gaps) -> list[float]:
        """The gaps, sorted, those within ``CLUSTER_S`` of the one before merged into it."""
        out: list[float] = []
        last = None
        for g in sorted(gaps):
            if last is None or g - last > self.CLUSTER_S:
                out.append(g)
            last = g
        return out
