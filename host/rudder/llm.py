"""The Python API: load a model, then generate (batched) or stream.

    from rudder import LLM, SamplingParams
    llm = LLM("smollm2")
    [out] = llm.generate(["Name a colour."], SamplingParams(max_tokens=20), chat=True)
    print(out.text)
    out = llm.chat([{"role": "user", "content": "A colour as JSON."}],
                   SamplingParams(json_schema={"type": "object", "properties": {"colour": {"type": "string"}}}))
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Iterable, Iterator

import torch

from .engine import Completion, Controller, Delta, Engine, EngineConfig, SamplingParams
from .engine.output import HeldStream
from .healing import check_chat, check_controller
from .loading import load_config, load_model, load_tokenizer
from .precision import activation_dtype, resolve
from .reasoning import Reasoning, ReasoningSplitter, split
from .constraint_plan import from_params

__all__ = ["LLM"]


def _pipeline_kv_tokens(model: str, precision: str, device, config: EngineConfig) -> int:
    """The KV cache size of a pipeline, from this machine's memory (under torchrun, rank 0's size
    is every stage's)."""
    from .engine.kv_cache import tokens_for_memory

    cfg = load_config(model)
    return tokens_for_memory(cfg, activation_dtype(precision, device), device, config.kv_cache_memory,
                             config.max_seqs * cfg.max_position)


class LLM:
    def __init__(self, model: str = "smollm2", *, device: str | torch.device = "cpu", dtype: str = "auto",
                 controller_limits=None,
                 pipeline_stages: int | list[int] | None = None, pipeline_threads: int | None = None,
                 pipeline_timeout: float = 60.0, config: EngineConfig | None = None,
                 guest_memory_bytes: int | None = None, snapshot_bytes: int | None = None, **engine_options):
        """`model`: "smollm2", "tiny" (random weights), a .gguf file or a Hugging Face-style folder.
        `config` (or its fields as keyword arguments: kv_cache_tokens, max_batch_tokens, max_seqs,
        micro_batches...) sizes the engine (engine/config.py; the CLI and the server share its
        defaults).

        `dtype`: the weight precision, "auto" (bf16 where the CPU has native bf16, else fp32),
        "fp32", "bf16" or "int8" (docs/performance.md); `self.dtype` is the one in use. An unknown
        name is a ValueError before anything loads.

        `pipeline_stages`: split the model's layers over that many processes (or a list of
        layers per stage), driven over torch.distributed (docs/pipeline.md); this process is the
        coordinator and stage 0. `pipeline_threads`: torch threads per stage (default: the CPU
        cores shared out); `pipeline_timeout`: seconds a stage may take before the pipeline is
        declared dead. A pipeline runs one micro-batch per stage unless `micro_batches` says.

        `controller_limits` lowers the controllers' per-request limits (docs/abi.md);
        `guest_memory_bytes` and `snapshot_bytes` are the sandbox's memory budgets for all live
        controller instances and for the post-init snapshots of loaded modules."""
        config = EngineConfig.of(**engine_options) if config is None else config.replace(**engine_options)
        precision = resolve(dtype, device)  # a bad name fails here, before the weights load
        runner = None
        if pipeline_stages is None or pipeline_stages == 1:
            self.model, self.tokenizer = load_model(model, device, dtype=precision)
        else:
            from .pipeline import start_pipeline

            if config.kv_cache_tokens is None:
                config = config.replace(kv_cache_tokens=_pipeline_kv_tokens(model, precision, device, config))
            self.model, factory = start_pipeline(
                model, pipeline_stages, kv_cache_tokens=config.kv_cache_tokens, block_size=config.block_size,
                device=str(device), threads=pipeline_threads, timeout=pipeline_timeout, dtype=precision)
            self.tokenizer = load_tokenizer(model)
            if engine_options.get("micro_batches") is None:
                config = config.replace(micro_batches=self.model.stage.num_stages)
            runner = factory(config.num_blocks, config.block_size)
        self.dtype = self.model.precision
        self.engine = Engine(self.model, self.tokenizer, config, runner=runner)
        self._controller_limits = controller_limits
        self._runtime_options = {k: v for k, v in (("guest_memory_bytes", guest_memory_bytes),
                                                   ("snapshot_bytes", snapshot_bytes)) if v is not None}
        self._runtime = None

    def close(self) -> None:
        """Stop the pipeline stages, if any (also done at exit)."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def runtime(self):
        """The Wasm controller runtime (created on first use)."""
        if self._runtime is None:
            from .controller import ControllerRuntime, Limits

            self._runtime = ControllerRuntime(self.tokenizer, self._controller_limits or Limits(), **self._runtime_options)
        return self._runtime

    def start_controller(self, controller: "str | Path | bytes", arg: str | bytes = "", limits=None,
                         seed: int | None = None) -> Controller:
        """A controller for one request: a built-in name (`rudder controllers`), a .wasm path, or
        wasm bytes; `arg` is its argument; `seed` (the request's) seeds a component controller's
        random numbers. Raises ControllerError/ValueError on bad input."""
        from .controller.build import builtin_controller

        if isinstance(controller, (bytes, bytearray)):
            wasm = bytes(controller)
        elif str(controller).endswith(".wasm") or Path(controller).is_file():
            path = Path(controller)
            if not path.is_file():
                raise ValueError(f"no such controller file: {path}")
            wasm = path.read_bytes()
        else:
            wasm = builtin_controller(str(controller)).read_bytes()
        return self.runtime.start(self.runtime.load(wasm), arg, limits, seed=seed)

    def check_params(self, params: SamplingParams) -> SamplingParams:
        """Validate `params` against this model (token ids of logit_bias) and what its runner can do
        (engine/runner.py's Capabilities); raises ValueError naming the field."""
        if params.logit_bias:
            bad = [t for t in params.logit_bias if not 0 <= int(t) < self.tokenizer.vocab_size]
            if bad:
                raise ValueError(f"logit_bias: token id {bad[0]} is outside the vocabulary "
                                 f"(0..{self.tokenizer.vocab_size - 1})")
        self.engine.runner.capabilities.refuse(params)
        return params

    def steer(self, params: SamplingParams | None, controller, controller_arg):
        """(params for the engine, controller, argument): a structured-output field of `params`
        becomes its built-in controller (after a reasoning phase, if params ask for one)."""
        params = params or SamplingParams()
        constraint = from_params(params)
        if params.reasoning not in (None, False) and controller is not None:
            raise ValueError("reasoning works with the built-in structured output (json_schema, regex, choice, "
                             "grammar, structural_tag), not with a controller")
        if constraint is not None:
            if controller is not None:
                raise ValueError(f"{constraint.source} and controller: give one of them")
            controller, controller_arg = constraint.controller, constraint.arg
        if params.token_healing and controller is not None and not hasattr(controller, "mid_process"):
            # (a started one is checked by the engine; none: `heal`, see _healer)
            check_controller(controller, "reasoning" if params.reasoning not in (None, False)
                             else constraint.source if constraint is not None else None)
        params = dataclasses.replace(params, json_schema=None, regex=None, choice=None, grammar=None,
                                     structural_tag=None, json_undeclared=None, reasoning=None)
        return self.check_params(params.validate()), controller, controller_arg

    def prompt_text(self, prompt: str | list[dict] | list[int], chat: bool) -> str | list[int]:
        """A chat prompt (a message list, or one user message) is rendered with the model's
        template; a list of token ids passes through."""
        if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            return self.tokenizer.apply_chat_template(prompt)
        if isinstance(prompt, list):
            return prompt
        if chat:
            return self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        return prompt

    def generate(self, prompts: str | list[str] | list[list[dict]], params: SamplingParams | list[SamplingParams] | None = None,
                 *, chat: bool = False, controller=None, controller_arg: str | bytes = "", controller_limits=None,
                 controllers: Iterable[Controller | None] | None = None, trace: bool = False) -> list[Completion]:
        """Run all prompts concurrently (continuous batching); one Completion per prompt, in order.

        `controller` (a built-in name, .wasm path or bytes) with `controller_arg` steers every
        prompt, each with its own instance; `controllers` gives one ready controller per prompt.
        Structured output in `params` (json_schema, regex, choice, grammar) picks the built-in
        controller itself. A request that forked has all its sequences in `completion.branches`
        (itself first). `trace=True`: each completion's `trace` lists the Branch records applied
        to it, step by step (engine/trace.py: backtrack, the mask as a bitarray, ff lists, the
        controller's time; `step.describe(llm.tokenizer)` reads as one line)."""
        if isinstance(prompts, str):
            prompts = [prompts]
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if not len(params_list) == len(prompts):
            raise ValueError("prompts and params must have the same length")
        thinking = [Reasoning.of(p.reasoning) for p in params_list]
        for p, sp in zip(prompts, params_list):
            check_chat(sp, chat or not isinstance(p, str) and bool(p) and isinstance(p[0], dict))
        if controllers is not None and controller is not None:
            raise ValueError("pass either controller or controllers, not both")
        steered = [self.steer(p, controller, controller_arg) for p in params_list]
        if controllers is not None:
            if any(c is not None for _, c, _ in steered):
                raise ValueError("structured output in params and controllers: give one of them")
            ctls = list(controllers)
        else:
            ctls = []
            try:
                for p, name, arg in steered:
                    _, name, arg = _healer(p, name, arg)
                    ctls.append(None if name is None else self.start_controller(name, arg, controller_limits, p.seed))
            except BaseException:
                for c in ctls:
                    if c is not None:
                        c.close()
                raise
        if len(ctls) != len(prompts):
            raise ValueError("prompts, params and controllers must have the same length")
        requests = []
        try:
            for p, (sp, _, _), c in zip(prompts, steered, ctls):
                requests.append(self.engine.add_request(self.prompt_text(p, chat), sp, c, trace=trace))
        except BaseException:  # the engine closed the refused one's controller; cancel and close the rest
            for r in requests:
                self.engine.cancel(r.request_id)
            for c in ctls[len(requests) + 1:]:
                if c is not None:
                    c.close()
            raise
        try:
            while not all(r.finished for r in requests):
                self.engine.step()
        except BaseException:
            for r in requests:
                self.engine.cancel(r.request_id)
            raise
        results = []
        for r, reasoning in zip(requests, thinking):
            branches = self.engine.completions(r)
            if reasoning is not None:
                for b in branches:
                    b.reasoning, answer = split(b.text, reasoning)
                    b.text = answer or ""
            branches[0].branches = branches
            results.append(branches[0])
            self.engine.forget(r)
        return results

    def stream(self, prompt: str | list[dict], params: SamplingParams | None = None, *, chat: bool = False,
               controller=None, controller_arg: str | bytes = "", controller_limits=None,
               trace: bool = False) -> Iterator[Delta]:
        """Yield text deltas as they are decoded (`delta.branch` tells forks apart). Closing the
        iterator cancels the request. `controller`: a ready controller, a built-in name, a .wasm
        path or wasm bytes (with `controller_arg`); or structured output in `params`. `trace`:
        each branch's last delta carries the Branch records applied to it (see `generate`)."""
        reasoning = Reasoning.of((params or SamplingParams()).reasoning)
        check_chat(params, chat or not isinstance(prompt, str) and bool(prompt) and isinstance(prompt[0], dict))
        params, controller, controller_arg = _healer(*self.steer(params, controller, controller_arg))
        if controller is not None and not hasattr(controller, "mid_process"):
            controller = self.start_controller(controller, controller_arg, controller_limits, params.seed)
        req = self.engine.add_request(self.prompt_text(prompt, chat), params, controller, trace=trace)
        split_off = _ThinkingStream(reasoning) if reasoning is not None else None
        try:
            while not req.finished:
                for delta in self.engine.step():
                    if delta.request_id == req.request_id:
                        if delta.finished and req.spec_stats is not None:
                            delta.speculative = req.spec_stats.as_dict(sum(s.num_output for s in req.seqs))
                        if delta.finished and req.trace is not None:
                            delta.trace = [t for t in req.trace if t.branch == delta.branch]
                        yield delta if split_off is None else split_off.push(delta)
        finally:
            if not req.finished:
                self.engine.cancel(req.request_id)
            self.engine.forget(req)

    def chat(self, messages: list[dict] | list[list[dict]], params: SamplingParams | None = None, *,
             controller=None, controller_arg: str | bytes = "", controller_limits=None) -> Completion | list[Completion]:
        """Answer a conversation (a list of {"role", "content"} messages) with the model's chat
        template; a list of conversations runs them concurrently and returns a list."""
        if messages and all(isinstance(m, list) for m in messages):
            return self.generate(list(messages), params, controller=controller, controller_arg=controller_arg,
                                 controller_limits=controller_limits)
        if not messages or not all(isinstance(m, dict) for m in messages):
            raise ValueError("messages: a list of {'role': ..., 'content': ...} dicts (or a list of such lists)")
        return self.generate([messages], params, controller=controller, controller_arg=controller_arg,
                             controller_limits=controller_limits)[0]


class _ThinkingStream:
    """A reasoning request's deltas with the thinking split off (`delta.reasoning`): text is held
    until the one token the `triggers` controller may take back at the end marker has passed."""

    def __init__(self, reasoning: Reasoning):
        self.reasoning = reasoning
        self.branches: dict[int, tuple[HeldStream, ReasoningSplitter]] = {}

    def push(self, delta: Delta) -> Delta:
        held, splitter = self.branches.setdefault(delta.branch, (HeldStream(1), ReasoningSplitter(self.reasoning)))
        piece = held.push(delta)
        thinking, answer = splitter.feed(piece.text)
        if delta.finished:
            more_thinking, more_answer = splitter.finish()
            thinking, answer = thinking + more_thinking, answer + more_answer
        logprobs = [lp for lp in piece.logprobs if lp is not None]
        return dataclasses.replace(delta, text=answer, reasoning=thinking, token_ids=piece.token_ids,
                                   logprobs=logprobs, backtrack_chars=0, backtrack_tokens=0)


def _healer(params: SamplingParams, controller, arg):
    """Token healing goes through a controller: with no constraint, the built-in `heal`."""
    if controller is None and params.token_healing:
        return params, "heal", ""
    return params, controller, arg
