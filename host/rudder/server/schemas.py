"""Request bodies (pydantic). Unknown fields are ignored, as OpenAI clients send many; fields we
know and do not support are declared here and refused by name (`refuse_unsupported`), never
silently ignored."""

from __future__ import annotations

import json
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .errors import unsupported


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


def _arg_text(value: Any) -> str:
    """A controller argument: a string as is; a JSON object or list as its JSON text (AICI)."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False)


class Sampling(_Body):
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=100)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1)  # vLLM's -1 means off, as our 0
    min_p: float = Field(0.0, ge=0, le=1)
    seed: Optional[int] = None
    stop: Union[str, list[str], None] = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0, le=10)
    logit_bias: Optional[dict[str, float]] = None
    ignore_eos: bool = False
    # Speculative decoding (docs/speculative.md): "lookup" or "draft", at most spec_k drafts a step.
    speculative: Optional[Literal["lookup", "draft"]] = None
    spec_k: int = Field(8, ge=1, le=32)


class Message(_Body):
    role: str
    content: Union[str, list[dict[str, Any]], None] = ""
    name: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None
    tool_call_id: Optional[str] = None

    def text(self) -> str:
        """Content as text (OpenAI's list-of-parts form: the text parts joined; other parts refused)."""
        if isinstance(self.content, list):
            kinds = {p.get("type") for p in self.content} - {"text", "input_text"}
            if kinds:
                raise unsupported(f"message content of type {sorted(map(str, kinds))[0]}", "only text parts")
            return "".join(p.get("text", "") for p in self.content)
        return self.content or ""


class TraceOptions(_Body):
    """`"trace": {...}`: a trace event per applied Branch (docs/server.md, "Trace events");
    `masks` adds each mask's words (base64), not only its summary."""

    masks: bool = False


def _trace_options(value) -> Optional[TraceOptions]:
    if value is True:
        return TraceOptions()
    return value or None


class RunRequest(Sampling):
    """POST /v1/run: a controller (tag or module id), its argument, and a prompt or messages."""

    controller: Optional[str] = None
    controller_arg: Any = ""
    controller_limits: Optional[dict[str, float]] = None
    prompt: Optional[str] = None
    messages: Optional[list[Message]] = None
    stream: bool = True
    max_backtrack: Optional[int] = Field(None, ge=0)
    # AICI's stream (an "initial-run" event, "run" events with forks, then [DONE]); by default
    # when the request has neither prompt nor messages, as AICI clients send.
    aici: Optional[bool] = None
    token_healing: Optional[bool] = None  # declared to be refused: the controller here is the client's own
    trace: Union[bool, TraceOptions] = False

    @field_validator("token_healing")
    @classmethod
    def _no_healing(cls, v):
        if v:
            raise ValueError("applies to /v1/completions (a controller of your own here decides the tokens)")
        return v

    @property
    def arg(self) -> str:
        return _arg_text(self.controller_arg)

    @property
    def trace_options(self) -> Optional[TraceOptions]:
        return _trace_options(self.trace)


class RudderExtension(_Body):
    """The `rudder` field of an OpenAI request: steer it with any controller, or a shorthand for
    a built-in one; `max_backtrack` declares the controller's backtrack depth (once that many
    tokens follow a token it never takes it back: the stream holds that much), `stream_backtrack`
    streams raw deltas with `rudder_backtrack`."""

    controller: Optional[str] = None
    controller_arg: Any = ""
    controller_limits: Optional[dict[str, float]] = None
    regex: Optional[str] = None
    grammar: Optional[str] = None
    json_schema: Optional[Any] = None
    choice: Optional[list[str]] = None
    structural_tag: Optional[Any] = None
    max_backtrack: Optional[int] = Field(None, ge=0)
    stream_backtrack: bool = False
    trace: Union[bool, TraceOptions] = False

    @property
    def arg(self) -> str:
        return _arg_text(self.controller_arg)

    @property
    def trace_options(self) -> Optional[TraceOptions]:
        return _trace_options(self.trace)


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: Optional[dict[str, Any]] = None  # {"name", "schema", "strict"}
    # structural_tag: XGrammar's {"format": ...} or the original {"structures", "triggers"}
    format: Optional[Any] = None
    structures: Optional[Any] = None
    triggers: Optional[Any] = None


class StructuredOutputs(_Body):
    """vLLM's `structured_outputs` (and, field by field, its older `guided_*`)."""

    json_: Optional[Any] = Field(None, alias="json")
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    disable_any_whitespace: Optional[bool] = None
    disable_additional_properties: Optional[bool] = None
    whitespace_pattern: Optional[str] = None
    disable_fallback: Optional[bool] = None  # we never fall back: honoured as is
    structural_tag: Optional[Any] = None


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


# Fields clients send that this server knows and does not support, with the values that ask for
# nothing (those pass).
UNSUPPORTED = {
    "functions": (None, []), "function_call": (None,), "audio": (None,), "modalities": (None, ["text"]),
    "prediction": (None,), "store": (None, False), "metadata": (None, {}), "reasoning_effort": (None,),
    "web_search_options": (None,), "service_tier": (None, "auto", "default"), "min_tokens": (None, 0),
    "stop_token_ids": (None, []), "include_stop_str_in_output": (None, False), "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True), "best_of": (None, 1), "use_beam_search": (None, False),
    "length_penalty": (None, 1.0), "prompt_logprobs": (None,), "add_generation_prompt": (None, True),
    "continue_final_message": (None, False), "chat_template": (None,), "chat_template_kwargs": (None, {}),
    "documents": (None, []), "priority": (None, 0), "truncate_prompt_tokens": (None,), "bad_words": (None, []),
    "allowed_token_ids": (None,), "return_tokens_as_token_ids": (None, False), "suffix": (None, ""),
    "vllm_xargs": (None,), "kv_transfer_params": (None,),
    "return_hidden_states": (None, False), "lora_path": (None,), "verbosity": (None,),
}


class _OpenAIBody(Sampling):
    model: Optional[str] = None
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[StructuredOutputs] = None
    guided_json: Optional[Any] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    guided_decoding_backend: Optional[str] = None  # any value: every backend name maps to ours
    guided_whitespace_pattern: Optional[str] = None
    regex: Optional[str] = None          # SGLang
    ebnf: Optional[str] = None           # SGLang (GBNF)
    json_schema: Optional[Any] = None    # SGLang: a schema as JSON text
    structural_tag: Optional[Any] = None  # vLLM's older top-level field (JSON text or an object)
    # "allow": JSON Schemas may generate undeclared properties (the specification's reading);
    # the default, "forbid", generates only the properties an object declares.
    json_undeclared: Optional[Literal["forbid", "allow"]] = None
    thinking_token_budget: Optional[int] = Field(None, ge=0)  # vLLM: the thinking's most tokens
    rudder: Optional[RudderExtension] = None
    token_healing: bool = False          # completions: take back the prompt's end, write it again (healing.py)
    user: Optional[str] = None           # logged with the request
    request_id: Optional[str] = None     # vLLM: the response's id
    # declared so refuse_unsupported can name them (see UNSUPPORTED)
    functions: Optional[Any] = None
    function_call: Optional[Any] = None
    audio: Optional[Any] = None
    modalities: Optional[Any] = None
    prediction: Optional[Any] = None
    store: Optional[Any] = None
    metadata: Optional[Any] = None
    reasoning_effort: Optional[Any] = None
    web_search_options: Optional[Any] = None
    service_tier: Optional[Any] = None
    min_tokens: Optional[Any] = None
    stop_token_ids: Optional[Any] = None
    include_stop_str_in_output: Optional[Any] = None
    skip_special_tokens: Optional[Any] = None
    spaces_between_special_tokens: Optional[Any] = None
    best_of: Optional[Any] = None
    use_beam_search: Optional[Any] = None
    length_penalty: Optional[Any] = None
    prompt_logprobs: Optional[Any] = None
    add_generation_prompt: Optional[Any] = None
    continue_final_message: Optional[Any] = None
    chat_template: Optional[Any] = None
    chat_template_kwargs: Optional[Any] = None
    documents: Optional[Any] = None
    priority: Optional[Any] = None
    truncate_prompt_tokens: Optional[Any] = None
    bad_words: Optional[Any] = None
    allowed_token_ids: Optional[Any] = None
    return_tokens_as_token_ids: Optional[Any] = None
    vllm_xargs: Optional[Any] = None
    kv_transfer_params: Optional[Any] = None
    return_hidden_states: Optional[Any] = None
    lora_path: Optional[Any] = None
    verbosity: Optional[Any] = None
    suffix: Optional[Any] = None

    def refuse_unsupported(self) -> None:
        for name, benign in UNSUPPORTED.items():
            value = getattr(self, name, None)
            if value is not None and value not in benign:
                raise unsupported(name)


class CompletionRequest(_OpenAIBody):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = Field(16, ge=1)  # OpenAI's default for completions
    echo: bool = False
    logprobs: Optional[int] = Field(None, ge=0, le=20)

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be empty")
        return v


class ChatRequest(_OpenAIBody):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: Optional[bool] = None
    echo: Optional[Any] = None  # vLLM's chat echo: refused unless false

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.echo not in (None, False):
            raise unsupported("echo", "in chat completions (it is supported in /v1/completions)")


class TagRequest(_Body):
    """POST /v1/controllers/tags: `tag` or (AICI) `tags`, naming `module_id`."""

    tag: Optional[str] = Field(None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    tags: Optional[list[str]] = None
    module_id: str = Field(pattern=r"^[0-9a-f]{64}$")
    max_backtrack: Optional[int] = Field(None, ge=0)

    @field_validator("tags")
    @classmethod
    def _tag_names(cls, v):
        if v is not None:
            import re

            if not v or any(not isinstance(t, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", t) for t in v):
                raise ValueError("tags are 1-64 letters, digits, _ . -")
        return v

    def names(self) -> list[str]:
        names = ([self.tag] if self.tag else []) + list(self.tags or [])
        if not names:
            raise ValueError("give tag or tags")
        return list(dict.fromkeys(names))
