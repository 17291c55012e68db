"""Admission: what a request takes while it runs - its request_id among the live ones, across replicas, and the tokens
its tenant's rate limits reserved for it (prompt + max_tokens) - held as one object that gives it all back once.

    admission = admissions.admit(request, tenant, max_tokens_set)   # or AlreadyRunning / InvalidArgument / OverLimit
    with admission:
        ... stream; admission.sent += n per message ...
    # released: the id is free, the reserved tokens not spent go back to the tenant

A stream may release earlier (the id is free the moment its request ends, so a client can send it again at once);
the `with` then does nothing more.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from blockspec.services.router.limits import TenantLimits
from blockspec.services.router.step_loop import Request


class AlreadyRunning(Exception):
    """Another live stream holds the request_id."""


@dataclass(eq=False)
class Admission:
    request: Request  # as admitted: its max_tokens may be the most the tenant's buckets held
    tenant: str
    admissions: Admissions
    sent: int = 0  # generated tokens the stream has carried: spent
    prompt_spent: bool = True  # False: no replica took the request, so its prompt's tokens come back too
    released: bool = False

    def release(self) -> None:
        """Give back what the request took, once."""
        if not self.released:
            self.released = True
            self.admissions.give_back(self)

    def __enter__(self) -> Admission:
        return self

    def __exit__(self, *_exc) -> None:
        self.release()


class Admissions:
    """The live request_ids of a service (each scheduler knows only its own) and the tenants' rate limits."""

    def __init__(self, limits: TenantLimits | None) -> None:
        self.limits = limits if limits is not None and limits.enabled else None
        self._live: dict[str, Request] = {}

    def admit(self, request: Request, tenant: str, max_tokens_set: bool) -> Admission:
        """Take the request's id and reserve prompt + max_tokens from its tenant (an unset max_tokens, the rest of the
        context, is cut to what the tenant's buckets hold now). AlreadyRunning before any budget is taken;
        InvalidArgument where more than a whole bucket is asked; OverLimit where the buckets lack room now."""
        if request.request_id in self._live:
            raise AlreadyRunning(f"request_id: {request.request_id!r} is already running")
        if self.limits is not None:
            prompt = len(request.prompt_ids)
            if max_tokens_set:
                self.limits.admit(tenant, prompt + request.max_tokens)
            else:  # as many as the tenant's token buckets hold now
                request = replace(request, max_tokens=self.limits.admit_up_to(tenant, prompt, request.max_tokens))
        self._live[request.request_id] = request
        return Admission(request, tenant, self)

    def give_back(self, admission: Admission) -> None:
        """The id is free again (unless a later stream took it already: a client may resend under an id as soon as
        its stream began to end), and the reserved tokens not spent go back to the tenant."""
        request = admission.request
        if self._live.get(request.request_id) is request:
            del self._live[request.request_id]
        if self.limits is not None:
            unspent = request.max_tokens - admission.sent + (0 if admission.prompt_spent else len(request.prompt_ids))
            self.limits.refund(admission.tenant, unspent)

