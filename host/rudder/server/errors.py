"""Errors as JSON: `{"error": {"type", "message", ...}}` (the OpenAI shape, so its client shows
them). `type` is stable; a controller's failure adds its `kind` (docs/abi.md) and log tail."""

from __future__ import annotations

from ..controller.errors import KINDS, ControllerError

EMPTY_MASK = "the sample mask allowed no token"  # engine/branching.py's words (Steering.take_sample)

STATUS = {
    "invalid_request": 400,
    "controller_error": 400,
    "forbidden": 403,
    "not_found": 404,
    "payload_too_large": 413,
    "too_many_requests": 429,
    "engine_error": 503,
    "internal_error": 500,
}


class APIError(Exception):
    def __init__(self, type_: str, message: str, **extra):
        super().__init__(message)
        self.type = type_
        self.extra = extra

    @property
    def status(self) -> int:
        return STATUS[self.type]

    def body(self) -> dict:
        return {"error": {"type": self.type, "message": str(self), **self.extra}}


def controller_error(e: ControllerError) -> APIError:
    return APIError("controller_error", str(e), kind=e.kind, log_tail=e.log_tail)


def from_finish(message: str, log_tail: str) -> APIError:
    """The error of a request the engine ended with finish_reason "error". The engine words a
    controller's failure "controller <kind>: ..." (engine/branching.py, Steering.apply_answer)."""
    words = message.split(":", 1)[0].split()
    if len(words) == 2 and words[0] == "controller":
        kind = words[1] if words[1] in KINDS or words[1] == "invalid_branch" else "error"
        return APIError("controller_error", message, kind=kind, log_tail=log_tail)
    if message == EMPTY_MASK:  # the controller's mask left nothing to sample
        return APIError("controller_error", message, kind="invalid_result", log_tail=log_tail)
    return APIError("engine_error", message)
