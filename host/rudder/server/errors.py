"""Errors as JSON in the OpenAI shape: `{"error": {"message", "type", "param", "code"}}`, so
OpenAI clients show them. `type` is stable (its HTTP status below); `param` names the request
field at fault, `code` is a machine-readable reason where one helps. A controller's failure adds
its `kind` (docs/abi.md) and the tail of its log; when it refused its argument, the reason it
logged is in `message` itself."""

from __future__ import annotations

from ..controller.errors import KINDS, ControllerError

EMPTY_MASK = "the sample mask allowed no token"  # engine/branching.py's words (Steering.take_sample)
RETRY_AFTER_S = 1  # what a 429 tells the client to wait

STATUS = {
    "invalid_request": 400,
    "controller_error": 400,
    "unauthorized": 401,
    "forbidden": 403,
    "not_found": 404,
    "conflict": 409,
    "payload_too_large": 413,
    "too_many_requests": 429,
    "internal_error": 500,
    "engine_error": 503,
    "unavailable": 503,  # busy for now (e.g. every compile slot taken): Retry-After says when to try again
}


class APIError(Exception):
    def __init__(self, type_: str, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict | None = None, **extra):
        super().__init__(message)
        self.type = type_
        self.param = param
        self.code = code
        self.headers = dict(headers or {})
        if type_ == "too_many_requests":
            self.headers.setdefault("Retry-After", str(RETRY_AFTER_S))
        self.extra = extra

    @property
    def status(self) -> int:
        return STATUS[self.type]

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code,
                          **self.extra}}


def unsupported(field: str, why: str = "") -> APIError:
    """A field this server knows and does not support: refused, never ignored."""
    return APIError("invalid_request", f"{field} is not supported by this server{': ' + why if why else ''}",
                    param=field, code="unsupported_parameter")


def _reason(log_tail: str) -> str:
    """The last line a controller logged: where the built-ins say why they refused."""
    lines = [ln.strip() for ln in log_tail.splitlines() if ln.strip() and ln.strip() != "[log truncated]"]
    return lines[-1] if lines else ""


def controller_error(e: ControllerError, controller: str | None = None, param: str | None = None) -> APIError:
    """A ControllerError as a 400. A controller that refused its argument (rudder_start returned
    non-zero) logged why: that reason is the message (e.g. `json: unsupported keyword "x" at #`)."""
    message = str(e)
    reason = _reason(e.log_tail)
    if e.kind == "start" and reason:
        message = f"the {controller or 'controller'} controller refused its argument: {reason}"
    elif e.kind == "init" and reason:
        message = f"{message}: {reason}"
    if e.busy:  # a shared resource (guest memory, instance slots) is in use now: the same request may pass later
        return APIError("too_many_requests", message, param=param, code=e.kind, kind=e.kind, log_tail=e.log_tail)
    return APIError("controller_error", message, param=param, code=e.kind, kind=e.kind, log_tail=e.log_tail)


def from_finish(message: str, log_tail: str) -> APIError:
    """The error of a request the engine ended with finish_reason "error". The engine words a
    controller's failure "controller <kind>: ..." (engine/branching.py, Steering.apply_answer)."""
    words = message.split(":", 1)[0].split()
    if len(words) == 2 and words[0] == "controller":
        kind = words[1] if words[1] in KINDS or words[1] == "invalid_branch" else "error"
        return APIError("controller_error", message, code=kind, kind=kind, log_tail=log_tail)
    if message == EMPTY_MASK:  # the controller's mask left nothing to sample
        return APIError("controller_error", message, code="invalid_result", kind="invalid_result",
                        log_tail=log_tail)
    return APIError("engine_error", message)
