"""Replica autoscaling on the queue: how many replicas the waiting requests ask for (`QueuePolicy`), with delays in
both directions, as Kubernetes' HorizontalPodAutoscaler computes it: desired = ceil(waiting / target), clamped to
[min_replicas, max_replicas]; a scale up once that has asked for more for `scale_up_delay_s`, a scale down (one
replica at a time) once it has asked for fewer for `scale_down_delay_s`. The serving side (services/serving/serve.py)
starts and drains the replicas."""

from __future__ import annotations

import math
from dataclasses import dataclass

from blockspec.common.config import AutoscalingConfig


@dataclass(frozen=True)
class Decision:
    replicas: int  # the replica count to go to
    reason: str  # logged with the decision


class QueuePolicy:
    """The decisions for one router; `decide` is asked about once a second with the queue and the live replicas."""

    def __init__(self, cfg: AutoscalingConfig) -> None:
        self.cfg = cfg
        self._more_since: float | None = None  # since when the queue has asked for more replicas than run
        self._fewer_since: float | None = None

    def wanted(self, waiting: int) -> int:
        """The replica count `waiting` requests ask for, within the bounds."""
        want = math.ceil(waiting / self.cfg.target_waiting_per_replica)
        return max(self.cfg.min_replicas, min(self.cfg.max_replicas, want))

    def decide(self, waiting: int, replicas: int, now: float) -> Decision | None:
        """A change to make now, or None. replicas: those serving or starting (draining ones do not count)."""
        want = self.wanted(waiting)
        if replicas < self.cfg.min_replicas:  # one lost (a verifier died): replaced at once
            self._more_since = self._fewer_since = None
            return Decision(self.cfg.min_replicas, f"{replicas} replicas are below min_replicas "
                                                   f"{self.cfg.min_replicas}")
        self._more_since = _since(self._more_since, now) if want > replicas else None
        self._fewer_since = _since(self._fewer_since, now) if want < replicas else None
        if self._more_since is not None and now - self._more_since >= self.cfg.scale_up_delay_s:
            self._more_since = None
            return Decision(want, f"{waiting} requests waiting over {replicas} replicas for "
                                  f"{self.cfg.scale_up_delay_s:g} s (target {self.cfg.target_waiting_per_replica:g} "
                                  "per replica)")
        if self._fewer_since is not None and now - self._fewer_since >= self.cfg.scale_down_delay_s:
            self._fewer_since = None
            return Decision(replicas - 1, f"{waiting} requests waiting asked for {want} of the {replicas} replicas "
                                          f"for {self.cfg.scale_down_delay_s:g} s")
        return None


def _since(started: float | None, now: float) -> float:
    return now if started is None else started
