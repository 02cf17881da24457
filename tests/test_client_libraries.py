"""The structured-output client libraries people use, against a real `rudder serve` with SmolLM2,
sampling at temperature 0.7: instructor (JSON_SCHEMA, TOOLS, TOOLS_STRICT) and
langchain-openai (`with_structured_output` by json_schema and function_calling, `bind_tools` with
a named tool, "required" over several tools, and "auto"). Each mode must return a parsed object for
every one of 10 seeds: a pydantic model's schema has no additionalProperties, and a client expects
only its declared fields (the server's default). The seeds of a mode run concurrently (the server
batches them). instructor's JSON, MD_JSON and PARALLEL_TOOLS modes (and langchain's json_mode)
ask for no schema (any JSON object, free text, or tool_choice "auto"): the schema is only in the
prompt, and SmolLM2 does not follow it; those are not structured output."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Literal, Optional

import pytest
from pydantic import BaseModel, Field

from rudder.server import ServerConfig
from serve_util import LiveServer

pytestmark = pytest.mark.model

SEEDS = range(10)
PROMPT = "Tell me about Paris, the capital of France."


class City(BaseModel):
    """A city."""

    name: str
    country: str
    population_millions: float


class Person(BaseModel):
    """A person (its strings bounded: at temperature 0.7 an unbounded name or hobby could run past
    max_tokens, as one of the ten seeds did on one machine, and the client then has no object)."""

    name: str = Field(max_length=40)
    age: int = Field(ge=0, le=130)
    email: Optional[str] = Field(default=None, max_length=40)
    hobbies: list[Annotated[str, Field(max_length=24)]] = Field(default_factory=list, max_length=3)
    role: Literal["engineer", "artist", "teacher"]


class Weather(BaseModel):
    """Get the weather in a city."""

    city: str
    unit: Literal["celsius", "fahrenheit"]


@pytest.fixture(scope="module")
def server():
    with LiveServer(ServerConfig(model="smollm2", max_concurrent=10, max_queue=32)) as s:
        yield s


def each_seed(call) -> list:
    with ThreadPoolExecutor(len(SEEDS)) as pool:
        return list(pool.map(call, SEEDS))


@pytest.mark.parametrize("mode", ["JSON_SCHEMA", "TOOLS", "TOOLS_STRICT"])
@pytest.mark.parametrize("model", [City, Person], ids=["City", "Person"])
def test_instructor(server, mode, model):
    import instructor
    from openai import OpenAI

    ic = instructor.from_openai(OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0),
                                mode=getattr(instructor.Mode, mode))
    prompt = PROMPT if model is City else "Invent a person who works as an engineer."

    def call(seed):
        return ic.chat.completions.create(model="smollm2", response_model=model, max_tokens=80 if model is City else 160,
                                          temperature=0.7, seed=seed, max_retries=0,
                                          messages=[{"role": "user", "content": prompt}])

    for out in each_seed(call):
        assert isinstance(out, model), out


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(server, method):
    from langchain_openai import ChatOpenAI

    def call(seed):
        # The seed is the model's own field: with_structured_output on `llm.bind(seed=...)` drops what was
        # bound, and each request would then sample unseeded (now and then rambling past max_tokens).
        llm = ChatOpenAI(base_url=server.url + "/v1", api_key="x", model="smollm2", temperature=0.7, max_tokens=80,
                         max_retries=0, seed=seed)
        return llm.with_structured_output(City, method=method).invoke(PROMPT)

    outs = each_seed(call)
    for out in outs:
        assert isinstance(out, City), out
    assert call(SEEDS[0]) == outs[0]  # the seed reached the server: the request repeats


@pytest.mark.parametrize("choice", ["named", "required", "auto"])
def test_langchain_bind_tools(server, choice):
    """A named tool and "required" over two tools always give a call whose arguments parse; "auto"
    gives text or calls, and every call parses (SmolLM2 answers this one in text: the tool format
    is ours, not its own; tests/test_openai_compat.py makes the tiny model call in auto)."""
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=server.url + "/v1", api_key="x", model="smollm2", temperature=0.7, max_tokens=80,
                     max_retries=0)
    tools = {"named": [Weather], "required": [Weather, City], "auto": [Weather, City]}[choice]
    tool_choice = {"named": "Weather", "required": "required", "auto": "auto"}[choice]
    bound = llm.bind_tools(tools, tool_choice=tool_choice)

    def call(seed):
        return bound.bind(seed=seed).invoke("What is the weather like in Paris? Use celsius.")

    calls = 0
    for msg in each_seed(call):
        assert not msg.invalid_tool_calls, msg.invalid_tool_calls
        if choice != "auto":
            assert msg.tool_calls, msg
        for c in msg.tool_calls:
            {"Weather": Weather, "City": City}[c["name"]].model_validate(c["args"])
            calls += 1
        if not msg.tool_calls:
            assert isinstance(msg.content, str) and msg.content
    if choice != "auto":
        assert calls >= len(SEEDS)
