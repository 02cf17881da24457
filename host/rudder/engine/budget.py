"""Progress budgets of a request (controller Limits; docs/abi.md, "Limits").

A controller can keep a sequence from ever growing - backtrack one and sample again, fast-forward
and take it back, fork and stop in turns - and neither max_tokens nor the context would end it:
it would hold a batch slot and burn compute for good. So every budget is measured against the
progress the request has made, its output tokens so far (in all its sequences, finished ones
included):
- a sequence may take `max_steps_per_token` steps per output token it holds (+ slack);
- the request may process `max_work_factor` tokens per token of prompt and output (+ slack):
  tokens appended (sampled or fast-forwarded), positions re-fed after a backtrack, and
  branching.FORK_WORK per fork;
- its controllers may use `controller_ms_per_token` of CPU time per token generated (+ slack).
Past any of them it fails with kind `limit`. An honest controller makes progress with its work,
so it stays far inside them, whatever it does; built-in controllers and speculative decoding do.
"""

from __future__ import annotations

from .sequence import Request

__all__ = ["over_budget", "STEP_SLACK", "WORK_SLACK", "TOKEN_SLACK"]

STEP_SLACK = 16  # steps a sequence may take before it must show output
WORK_SLACK = 64  # tokens of work granted up front
TOKEN_SLACK = 16  # tokens' worth of controller CPU time granted up front


def over_budget(req: Request) -> str | None:
    """Why the request is over one of its progress budgets, or None."""
    limits = req.limits
    output = sum(s.num_output for s in req.seqs)
    for seq in req.seqs:
        allowed = limits.max_steps_per_token * (seq.num_output + STEP_SLACK)
        if seq.steps > allowed:
            return (f"a sequence took {seq.steps} steps for the {seq.num_output} tokens it holds "
                    f"(max_steps_per_token {limits.max_steps_per_token:g}): a controller that keeps it from growing?")
    allowed = limits.max_work_factor * (len(req.prompt_ids) + output + WORK_SLACK)
    if req.work > allowed:
        return (f"the request processed {req.work} tokens (appended, re-fed and forked) for {output} output "
                f"tokens (max_work_factor {limits.max_work_factor:g}): a controller that takes back what it adds?")
    generated = req.usage.sampled_tokens + req.usage.ff_tokens
    allowed_ms = limits.controller_ms_per_token * (generated + TOKEN_SLACK)
    used_ms = 1000 * req.usage.controller_s
    if used_ms > allowed_ms:
        return (f"its controllers used {used_ms:.0f} ms of CPU time for {generated} tokens, over the "
                f"{limits.controller_ms_per_token:g} ms per token allowed")
    return None
