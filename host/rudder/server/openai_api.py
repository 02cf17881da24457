"""OpenAI-compatible endpoints: POST /v1/completions and /v1/chat/completions, streamed or not.

Constraints map onto the built-in controllers:
- `response_format: {"type": "json_schema", "json_schema": {"schema": S}}` -> `json` with S;
- `response_format: {"type": "json_object"}` -> `json` with `{}` (any JSON value);
- the extension field `rudder`: `{"regex": P}` -> `regex` with P, `{"grammar": G}` -> `grammar`
  with G, or `{"controller": tag or module id, "controller_arg": ..., "controller_limits": {...}}`;
- `n > 1` without a controller -> the `fork` controller with argument n (one choice per fork).
A stream that backtracks says so in an extension field of the choice: `rudder_backtrack` is the
number of characters to delete before appending `content`/`text`.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from .errors import APIError
from .schemas import ChatRequest, CompletionRequest
from .service import Service, sse


def controller_for(body) -> tuple[str | None, str, dict | None]:
    """(controller, argument, limits) that a request's constraints ask for."""
    wanted = []
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_schema":
        schema = (fmt.json_schema or {}).get("schema")
        if not isinstance(schema, dict):
            raise APIError("invalid_request", "response_format json_schema needs json_schema.schema (an object)")
        wanted.append(("json", json.dumps(schema)))
    elif fmt is not None and fmt.type == "json_object":
        wanted.append(("json", "{}"))
    ext = body.rudder
    limits = None
    if ext is not None:
        limits = ext.controller_limits
        if ext.regex is not None:
            wanted.append(("regex", ext.regex))
        if ext.grammar is not None:
            wanted.append(("grammar", ext.grammar))
        if ext.controller is not None:
            wanted.append((ext.controller, ext.controller_arg))
    if len(wanted) > 1:
        raise APIError("invalid_request", "give one constraint: response_format, rudder.regex, rudder.grammar "
                       "or rudder.controller")
    if body.n > 1:
        if wanted:
            raise APIError("invalid_request", "n > 1 works without a constraint only (it uses the fork "
                           "controller); with one, send n requests")
        wanted.append(("fork", str(body.n)))
    name, arg = wanted[0] if wanted else (None, "")
    return name, arg, limits


def add_routes(app: FastAPI) -> None:
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        svc: Service = request.app.state.service
        prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        if len(prompts) != 1:
            raise APIError("invalid_request", "send one prompt per request")
        return await _serve(svc, request, body, prompts[0], body.max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        svc: Service = request.app.state.service
        prompt = svc.prompt(None, body.messages)
        return await _serve(svc, request, body, prompt, body.max_completion_tokens or body.max_tokens, chat=True)


async def _serve(svc: Service, request: Request, body, prompt: str, max_tokens: int | None, chat: bool):
    controller, arg, limits = controller_for(body)
    params = svc.sampling(body, max_tokens)
    job = await svc.start(prompt, params, controller, arg, limits)
    head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}", "created": int(time.time()),
            "model": body.model or svc.config.model}
    if body.stream:
        usage = body.stream_options is not None and body.stream_options.include_usage
        return StreamingResponse(_stream(svc, job, request, head, chat, usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    result = await svc.result(job, request)
    choices = []
    for c in result.completions:
        choice = {"index": c.branch, "finish_reason": c.finish_reason, "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": c.text}
        else:
            choice["text"] = c.text
        choices.append(choice)
    return {**head, "object": "chat.completion" if chat else "text_completion", "choices": choices,
            "usage": _usage(result)}


def _usage(result) -> dict:
    u = result.usage_dict()
    return {"prompt_tokens": u["prompt_tokens"], "completion_tokens": u["completion_tokens"],
            "total_tokens": u["prompt_tokens"] + u["completion_tokens"]}


async def _stream(svc: Service, job, request: Request, head: dict, chat: bool, include_usage: bool):
    obj = "chat.completion.chunk" if chat else "text_completion"
    started: set[int] = set()

    def chunk(choices: list[dict], **extra) -> str:
        return sse({**head, "object": obj, "choices": choices, **extra})

    async with contextlib.aclosing(svc.events(job, request)) as events:
        async for kind, *payload in events:
            if kind == "step":
                choices = []
                for d in payload[0]:
                    choice = {"index": d.branch, "finish_reason": d.finish_reason if d.finished else None,
                              "logprobs": None}
                    if chat:
                        choice["delta"] = {"content": d.text}
                        if d.branch not in started:
                            choice["delta"]["role"] = "assistant"
                    else:
                        choice["text"] = d.text
                    started.add(d.branch)
                    if d.backtrack_chars:
                        choice["rudder_backtrack"] = d.backtrack_chars
                    choices.append(choice)
                yield chunk(choices)
            elif kind == "error":
                yield sse(payload[0].body())
            else:
                result = payload[0]
                if result.error is not None:
                    yield sse(result.error.body())  # the openai client raises it as an APIError
                elif include_usage:
                    yield chunk([], usage=_usage(result))
    yield sse("[DONE]")
