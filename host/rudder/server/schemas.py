"""Request bodies (pydantic). Unknown fields are ignored, as OpenAI clients send many."""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class Sampling(_Body):
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    seed: Optional[int] = None
    stop: Union[str, list[str], None] = None
    # Speculative decoding (docs/speculative.md): "lookup" or "draft", at most spec_k drafts a step.
    speculative: Optional[Literal["lookup", "draft"]] = None
    spec_k: int = Field(8, ge=1, le=32)


class Message(_Body):
    role: str
    content: Union[str, list[dict[str, Any]], None] = ""

    def text(self) -> str:
        """Content as text (OpenAI's list-of-parts form: the text parts joined)."""
        if isinstance(self.content, list):
            return "".join(p.get("text", "") for p in self.content if p.get("type") == "text")
        return self.content or ""


class RunRequest(Sampling):
    """POST /v1/run: a controller (tag or module id), its argument, and a prompt or messages."""

    controller: Optional[str] = None
    controller_arg: str = ""
    controller_limits: Optional[dict[str, float]] = None
    prompt: Optional[str] = None
    messages: Optional[list[Message]] = None
    stream: bool = True
    ignore_eos: bool = False


class RudderExtension(_Body):
    """The `rudder` field of an OpenAI request: steer it with any controller. `regex` and
    `grammar` are shorthands for the built-in controllers of those names."""

    controller: Optional[str] = None
    controller_arg: str = ""
    controller_limits: Optional[dict[str, float]] = None
    regex: Optional[str] = None
    grammar: Optional[str] = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[dict[str, Any]] = None  # {"name", "schema", "strict"}


class StreamOptions(_Body):
    include_usage: bool = False


class _OpenAIBody(Sampling):
    model: Optional[str] = None
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    response_format: Optional[ResponseFormat] = None
    rudder: Optional[RudderExtension] = None


class CompletionRequest(_OpenAIBody):
    prompt: Union[str, list[str]]
    max_tokens: Optional[int] = Field(16, ge=1)


class ChatRequest(_OpenAIBody):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)


class TagRequest(_Body):
    tag: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    module_id: str = Field(pattern=r"^[0-9a-f]{64}$")
