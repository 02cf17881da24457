"""OpenAI-compatible endpoints: POST /v1/completions and /v1/chat/completions, streamed or not.

Which controller a request gets: dialects.py (every structured-output dialect) and tools.py
(tool calls). What a client sees:

- **Streams never show text that is taken back.** A controller declares a backtrack depth N
  (`max_backtrack`: once N tokens follow a token, it never takes it back; 0 for the built-in
  constraint controllers, twice the word's length for `backtrack`, a tag's declaration, or the
  request's `rudder.max_backtrack`); the stream holds each piece of text until N tokens follow it
  (engine/output.py, HeldStream). A controller that declared nothing is held until it ends.
  Taking back released text ends the request with an error. `rudder.stream_backtrack: true` streams the raw deltas instead, with
  `rudder_backtrack` (characters to delete first) on the choice.
- **Logprobs** (chat `logprobs`/`top_logprobs`, completions `logprobs`) are those of the
  distribution the token was drawn from (after logit_bias, penalties and the controller's mask,
  before temperature); a token the controller forced has logprob 0 (it had no alternative).
"""

from __future__ import annotations

import contextlib
import time
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request

from ..engine.output import BacktrackTooFar, HeldStream, Piece
from ..healing import check_controller
from ..reasoning import Reasoning, ReasoningSplitter, split
from .auth import ANONYMOUS
from .dialects import Steer, steer_of
from .errors import APIError, unsupported
from .schemas import ChatRequest, CompletionRequest
from .service import Service, event_stream, sse
from .tools import ToolCallParser, ToolPlan, render_messages


def add_routes(app: FastAPI) -> None:
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        svc: Service = request.app.state.service
        return await svc.until_disconnect(request, _completions(svc, body, request))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        svc: Service = request.app.state.service
        return await svc.until_disconnect(request, _chat(svc, body, request))


@dataclass
class _Shape:
    """How to answer: chat or completion, tools, logprobs, raw backtrack deltas, echo."""

    chat: bool
    n: int
    tools: ToolPlan | None = None
    logprobs: int | None = None      # top-n (0: only the token's), None: none
    raw: bool = False
    echo: list[str] | None = None    # per prompt (completions)
    reasoning: Reasoning | None = None  # chat: the thinking comes back as reasoning_content
    trace: Any = None                # rudder.trace's TraceOptions: rudder_trace with the choices

    @property
    def mode(self) -> str | None:
        return self.tools.mode if self.tools is not None else None


async def _chat(svc: Service, body: ChatRequest, request: Request):
    body.refuse_unsupported()
    svc.check_model(body.model)
    if body.token_healing:
        raise APIError("invalid_request", "token_healing applies to /v1/completions: a chat prompt ends with the chat "
                       "template's assistant header, not with text to heal", param="token_healing")
    reasoning = svc.config.reasoning
    plan = ToolPlan.of(body.tools, body.tool_choice, body.parallel_tool_calls, undeclared=body.json_undeclared,
                       reasoning=reasoning is not None)
    if plan is not None and plan.mode and body.n > 1:
        raise APIError("invalid_request", "n > 1 with tool calls is not supported: send n requests", param="n")
    messages = render_messages([{"role": m.role, "content": m.text(), "tool_calls": m.tool_calls}
                                for m in body.messages], plan)
    prompt = svc.chat_prompt(messages, plan.prompt_suffix if plan is not None else "")
    ids = svc.encode(prompt, "messages")
    steer = steer_of(body, plan, reasoning)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError("invalid_request", "top_logprobs needs logprobs: true", param="top_logprobs")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = svc.sampling(body, body.max_completion_tokens or body.max_tokens, len(ids), "messages",
                          logprobs=logprobs)
    shape = _Shape(True, body.n, plan if plan is not None and plan.mode else None, logprobs, _raw(body, plan),
                   reasoning=reasoning)
    if reasoning is not None and shape.raw:
        raise APIError("invalid_request", "rudder.stream_backtrack cannot be used with --reasoning-parser",
                       param="rudder.stream_backtrack")
    shape.trace = _trace(body, steer)
    jobs = await svc.start_all([(ids, params)], steer, _who(request), shape.trace)
    return await _respond(svc, jobs, body, shape, "chatcmpl")


async def _completions(svc: Service, body: CompletionRequest, request: Request):
    body.refuse_unsupported()
    svc.check_model(body.model)
    prompts = body.prompt
    if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    if body.echo and body.logprobs is not None:
        raise unsupported("echo with logprobs", "the prompt's logprobs are not computed")
    if body.thinking_token_budget is not None:
        raise APIError("invalid_request", "thinking_token_budget applies to /v1/chat/completions",
                       param="thinking_token_budget")
    steer = _healing(body, steer_of(body)) if body.token_healing else steer_of(body)
    specs, echo = [], []
    for i, p in enumerate(prompts):
        param = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        ids = svc.encode(p, param)
        specs.append((ids, svc.sampling(body, body.max_tokens, len(ids), param, logprobs=body.logprobs,
                                        token_healing=body.token_healing)))
        echo.append((p if isinstance(p, str) else svc.tokenizer.decode(ids)) if body.echo else "")
    shape = _Shape(False, body.n, None, body.logprobs, _raw(body, None), echo if body.echo else None,
                   trace=_trace(body, steer))
    jobs = await svc.start_all(specs, steer, _who(request), shape.trace)
    return await _respond(svc, jobs, body, shape, "cmpl")


def _healing(body: CompletionRequest, steer: Steer | None) -> Steer:
    """A token-healing request's controller: its constraint's built-in, or `heal` alone."""
    if steer is None:
        return Steer("heal", param="token_healing", max_backtrack=0)
    if steer.param == "n":
        raise APIError("invalid_request", "token_healing with n > 1 is not supported (n forks one request with the "
                       "fork controller, which does not heal): send n requests", param="token_healing")
    try:
        check_controller(steer.controller, f"{steer.param} ({steer.controller!r})")
    except ValueError as e:
        raise APIError("invalid_request", str(e), param="token_healing") from None
    return steer


def _who(request: Request):
    return getattr(request.state, "principal", ANONYMOUS)


def _trace(body, steer):
    """rudder.trace's options; a request without a controller has no Branch to trace."""
    trace = body.rudder.trace_options if body.rudder is not None else None
    if trace is not None and steer is None:
        raise APIError("invalid_request", "rudder.trace needs a controller: a structured-output field, tools, n > 1 "
                       "or rudder.controller (it lists the Branches a controller gave)", param="rudder.trace")
    return trace


def _trace_entries(svc: Service, shape: _Shape, job, steps) -> list[dict]:
    """Trace steps as rudder_trace entries (each with its choice's index)."""
    return [{"index": job.index * shape.n + t.branch, **t.as_dict(svc.tokenizer, mask=shape.trace.masks)}
            for t in steps]


def _raw(body, plan: ToolPlan | None) -> bool:
    raw = bool(body.rudder is not None and body.rudder.stream_backtrack)
    if raw and plan is not None and plan.mode:
        raise APIError("invalid_request", "rudder.stream_backtrack cannot be used with tool calls",
                       param="rudder.stream_backtrack")
    return raw


async def _respond(svc: Service, jobs, body, shape: _Shape, prefix: str):
    head = {"id": body.request_id or f"{prefix}-{uuid.uuid4().hex[:24]}", "created": int(time.time()),
            "model": body.model or svc.config.served_name}
    if body.stream:
        return event_stream(svc, jobs, _stream(svc, jobs, shape, head, body.stream_options))
    return await _whole(svc, jobs, shape, head)


# -- one choice -----------------------------------------------------------------------------------

class _Choice:
    """One choice as the engine's deltas arrive: what a client may see (held back while the
    controller could take it back), its tokens and logprobs, and its tool calls."""

    def __init__(self, index: int, window: int | None, shape: _Shape):
        self.index = index
        self.held = HeldStream(window)
        self.parser = ToolCallParser(shape.mode) if shape.mode else None
        self.thinking = ReasoningSplitter(shape.reasoning) if shape.reasoning is not None else None
        self.shown = Piece()  # released so far
        self.started = False
        self.finish_reason: str | None = None

    def push(self, delta, raw: bool) -> Piece:
        if raw:  # the delta as is (the client applies rudder_backtrack itself)
            piece = Piece(delta.text, list(delta.token_ids), [None] * len(delta.token_ids))
            if delta.logprobs and delta.token_ids:
                piece.logprobs[0] = delta.logprobs[0]
        else:
            piece = self.held.push(delta)
        self.shown.extend(piece)
        return piece


def _token_text(svc: Service, token: int) -> tuple[str, list[int]]:
    raw = svc.tokenizer.token_bytes[token]
    return raw.decode("utf-8", "replace"), list(raw)


def _chat_logprobs(svc: Service, piece: Piece, top_n: int) -> dict:
    content = []
    for token, lp in zip(piece.token_ids, piece.logprobs):
        text, raw = _token_text(svc, token)
        if lp is None:  # forced by the controller: it had no alternative
            top = [{"token": text, "logprob": 0.0, "bytes": raw}] if top_n else []
            content.append({"token": text, "logprob": 0.0, "bytes": raw, "top_logprobs": top})
            continue
        top = []
        for tid, value in lp["top"][:top_n]:
            t_text, t_raw = _token_text(svc, tid)
            top.append({"token": t_text, "logprob": value, "bytes": t_raw})
        content.append({"token": text, "logprob": lp["logprob"], "bytes": raw, "top_logprobs": top})
    return {"content": content, "refusal": None}


def _completion_logprobs(svc: Service, piece: Piece, top_n: int, offset: int) -> dict:
    tokens, values, tops, offsets = [], [], [], []
    for token, lp in zip(piece.token_ids, piece.logprobs):
        text, _ = _token_text(svc, token)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if lp is None:
            values.append(0.0)
            tops.append({text: 0.0} if top_n else {})
        else:
            values.append(lp["logprob"])
            tops.append({_token_text(svc, tid)[0]: v for tid, v in lp["top"][:top_n]})
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def _finish_reason(choice: _Choice, reason: str | None) -> str | None:
    if reason == "stop" and choice.parser is not None and choice.parser.calls:
        return "tool_calls"
    if reason == "cancelled":
        return "abort"
    return reason


# -- streaming ------------------------------------------------------------------------------------

async def _stream(svc: Service, jobs, shape: _Shape, head: dict, opts):
    obj = "chat.completion.chunk" if shape.chat else "text_completion"
    include_usage = opts is not None and opts.include_usage
    continuous = opts is not None and opts.continuous_usage_stats
    choices: dict[tuple[int, int], _Choice] = {}
    prompt_tokens = sum(len(j.prompt) for j in jobs)
    windows = {j.index: j.window for j in jobs}

    def usage() -> dict:
        done = sum(len(c.shown.token_ids) for c in choices.values())
        cached = sum(j.request.usage.cached_tokens for j in jobs if j.request is not None)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": done, "total_tokens": prompt_tokens + done,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def chunk(items: list[dict], **extra) -> str:
        if continuous and items:
            extra.setdefault("usage", usage())
        return sse({**head, "object": obj, "choices": items, **extra})

    def choice_of(job, branch: int) -> _Choice:
        key = (job.index, branch)
        if key not in choices:
            choices[key] = _Choice(job.index * shape.n + branch, windows[job.index], shape)
        return choices[key]

    async with contextlib.aclosing(svc.events(jobs)) as events:
        async for job, kind, *payload in events:
            if kind == "step":
                if payload[2]:  # a traced request's steps, in a chunk of their own
                    yield sse({**head, "object": obj, "choices": [],
                               "rudder_trace": _trace_entries(svc, shape, job, payload[2])})
                items: dict[int, dict] = {}  # one entry per choice per chunk, as OpenAI sends
                for d in payload[0]:
                    c = choice_of(job, d.branch)
                    try:
                        piece = c.push(d, shape.raw)
                    except BacktrackTooFar as e:  # ends the response; leaving cancels the jobs
                        yield sse(APIError("controller_error", str(e), param="rudder.max_backtrack",
                                           code="limit", kind="limit").body())
                        return
                    entry = _stream_entry(svc, shape, job, c, piece, d)
                    if entry is None:
                        continue
                    if c.index in items:  # a second delta of this choice in the step: its own chunk
                        yield chunk(list(items.values()))
                        items = {}
                    items[c.index] = entry
                if items:
                    yield chunk(list(items.values()))
            elif kind == "error":
                yield sse(payload[0].body())
                return
            elif payload[0].error is not None:
                yield sse(payload[0].error.body())  # the openai client raises it as an APIError
                return
    if include_usage:
        yield chunk([], usage=usage())
    yield sse("[DONE]")


def _stream_entry(svc: Service, shape: _Shape, job, c: _Choice, piece: Piece, d) -> dict | None:
    """The chunk entry for one released piece of one choice (and its end, if it ended); None
    when there is nothing to say."""
    logprobs = None
    if shape.logprobs is not None and piece.token_ids:
        logprobs = (_chat_logprobs(svc, piece, shape.logprobs) if shape.chat else
                    _completion_logprobs(svc, piece, shape.logprobs, len(c.shown.text) - len(piece.text)))
    entry: dict = {"index": c.index}
    if shape.raw and (d.backtrack_chars or d.backtrack_tokens):
        entry.update(rudder_backtrack=d.backtrack_chars, rudder_backtrack_tokens=d.backtrack_tokens)
    finish = _finish_reason(c, d.finish_reason) if d.finished else None
    if not shape.chat:
        text = piece.text
        if shape.echo is not None and not c.started:
            text = shape.echo[job.index] + text
        if not (text or logprobs or finish or len(entry) > 1 or not c.started):
            return None
        c.started = True
        c.finish_reason = finish
        return {**entry, "text": text, "logprobs": logprobs, "finish_reason": finish}
    delta: dict = {}
    text = piece.text
    if c.thinking is not None:
        thinking, text = c.thinking.feed(text)
        if d.finished:
            more_thinking, more_text = c.thinking.finish()
            thinking, text = thinking + more_thinking, text + more_text
        if thinking:
            delta["reasoning_content"] = thinking
    if c.parser is None:
        if text or not c.started and not delta:
            delta["content"] = text
    else:
        events = c.parser.feed(text) + (c.parser.finish() if d.finished else [])
        finish = _finish_reason(c, d.finish_reason) if d.finished else None  # calls are known now
        calls: dict[int, dict] = {}
        for ev in events:
            if ev[0] == "content":
                delta["content"] = delta.get("content", "") + ev[1]
            elif ev[0] == "call":
                calls[ev[1]] = {"index": ev[1], "id": ev[2], "type": "function",
                                "function": {"name": ev[3], "arguments": ""}}
            else:
                call = calls.setdefault(ev[1], {"index": ev[1], "function": {"arguments": ""}})
                call["function"]["arguments"] += ev[2]
        if calls:
            delta["tool_calls"] = list(calls.values())
    if not c.started:
        delta = {"role": "assistant", **delta}
    if not (delta or logprobs or finish or len(entry) > 1):
        return None
    c.started = True
    c.finish_reason = finish
    return {**entry, "delta": delta, "logprobs": logprobs, "finish_reason": finish}


# -- whole responses ------------------------------------------------------------------------------

async def _whole(svc: Service, jobs, shape: _Shape, head: dict) -> dict:
    choices: dict[tuple[int, int], _Choice] = {}
    async with contextlib.aclosing(svc.events(jobs)) as events:
        async for job, kind, *payload in events:
            if kind == "step":
                for d in payload[0]:
                    key = (job.index, d.branch)
                    if key not in choices:
                        choices[key] = _Choice(job.index * shape.n + d.branch, None, shape)
                    choices[key].push(d, raw=False)
            elif kind == "error":
                raise payload[0]
            elif payload[0].error is not None:
                raise payload[0].error
    out = []
    prompt_tokens = completion_tokens = 0
    for job in jobs:
        result = job.result
        prompt_tokens += result.prompt_tokens
        for comp in result.completions:
            c = choices.get((job.index, comp.branch)) or _Choice(job.index * shape.n + comp.branch, None, shape)
            completion_tokens += len(comp.token_ids)
            out.append(_whole_choice(svc, shape, job, c, comp))
            if shape.trace is not None:
                out[-1]["rudder_trace"] = _trace_entries(svc, shape, job, comp.trace)
    out.sort(key=lambda ch: ch["index"])
    return {**head, "object": "chat.completion" if shape.chat else "text_completion", "choices": out,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens,
                      "prompt_tokens_details": {"cached_tokens": sum(j.result.usage.cached_tokens for j in jobs)}}}


def _whole_choice(svc: Service, shape: _Shape, job, c: _Choice, comp) -> dict:
    text = comp.text
    logprobs = None
    if shape.logprobs is not None:
        logprobs = (_chat_logprobs(svc, c.shown, shape.logprobs) if shape.chat else
                    _completion_logprobs(svc, c.shown, shape.logprobs, 0))
    if not shape.chat:
        if shape.echo is not None:
            text = shape.echo[job.index] + text
        return {"index": c.index, "text": text, "logprobs": logprobs, "finish_reason": _finish_reason(c, comp.finish_reason)}
    message = {"role": "assistant", "content": text}
    if shape.reasoning is not None:
        message["reasoning_content"], answer = split(text, shape.reasoning)
        text = message["content"] = answer
    if c.parser is not None and text is not None:
        c.parser.feed(text)
        c.parser.finish()
        if c.parser.calls:
            message.update(content=c.parser.content or None, tool_calls=c.parser.tool_calls())
    return {"index": c.index, "message": message, "logprobs": logprobs,
            "finish_reason": _finish_reason(c, comp.finish_reason)}
