"""The Python API: load a model, then generate (batched) or stream.

    from rudder import LLM, SamplingParams
    llm = LLM("smollm2")
    [out] = llm.generate(["Name a colour."], SamplingParams(max_tokens=20), chat=True)
    print(out.text)
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Iterator

import torch

from .engine import Completion, Controller, Delta, Engine, EngineConfig, SamplingParams
from .loading import load_model, load_tokenizer

__all__ = ["LLM"]


class LLM:
    def __init__(self, model: str = "smollm2", *, device: str | torch.device = "cpu", controller_limits=None,
                 pipeline_stages: int | list[int] | None = None, pipeline_threads: int | None = None,
                 pipeline_timeout: float = 60.0, config: EngineConfig | None = None, **engine_options):
        """`model`: "smollm2", "tiny" (random weights), a .gguf file or a Hugging Face-style folder.
        `config` (or its fields as keyword arguments: kv_cache_tokens, max_batch_tokens, max_seqs,
        micro_batches...) sizes the engine (engine/config.py; the CLI and the server share its
        defaults).

        `pipeline_stages`: split the model's layers over that many processes (or a list of
        layers per stage), driven over torch.distributed (docs/pipeline.md); this process is the
        coordinator and stage 0. `pipeline_threads`: torch threads per stage (default: the CPU
        cores shared out); `pipeline_timeout`: seconds a stage may take before the pipeline is
        declared dead. A pipeline runs one micro-batch per stage unless `micro_batches` says."""
        config = EngineConfig.of(**engine_options) if config is None else config.replace(**engine_options)
        runner = None
        if pipeline_stages is None or pipeline_stages == 1:
            self.model, self.tokenizer = load_model(model, device)
        else:
            from .pipeline import start_pipeline

            self.model, factory = start_pipeline(
                model, pipeline_stages, kv_cache_tokens=config.kv_cache_tokens, block_size=config.block_size,
                device=str(device), threads=pipeline_threads, timeout=pipeline_timeout)
            self.tokenizer = load_tokenizer(model)
            if engine_options.get("micro_batches") is None:
                config = config.replace(micro_batches=self.model.stage.num_stages)
            runner = factory(config.num_blocks, config.block_size)
        self.engine = Engine(self.model, self.tokenizer, config, runner=runner)
        self._controller_limits = controller_limits
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

            self._runtime = ControllerRuntime(self.tokenizer, self._controller_limits or Limits())
        return self._runtime

    def start_controller(self, controller: "str | Path | bytes", arg: str | bytes = "", limits=None) -> Controller:
        """A controller for one request: a built-in name (`rudder controllers`), a .wasm path, or
        wasm bytes; `arg` is its argument. Raises ControllerError/ValueError on bad input."""
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
        return self.runtime.start(self.runtime.load(wasm), arg, limits)

    def _controllers_for(self, n: int, controller, controller_arg, controllers, limits=None) -> list:
        if controllers is not None:
            if controller is not None:
                raise ValueError("pass either controller or controllers, not both")
            return list(controllers)
        if controller is None:
            return [None] * n
        return [self.start_controller(controller, controller_arg, limits) for _ in range(n)]

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
                 controllers: Iterable[Controller | None] | None = None) -> list[Completion]:
        """Run all prompts concurrently (continuous batching); one Completion per prompt, in order.

        `controller` (a built-in name, .wasm path or bytes) with `controller_arg` steers every
        prompt, each with its own instance; `controllers` gives one ready controller per prompt.
        A request that forked has all its sequences in `completion.branches` (itself first)."""
        if isinstance(prompts, str):
            prompts = [prompts]
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        ctls = self._controllers_for(len(prompts), controller, controller_arg, controllers, controller_limits)
        if not len(params_list) == len(ctls) == len(prompts):
            raise ValueError("prompts, params and controllers must have the same length")
        requests = [self.engine.add_request(self.prompt_text(p, chat), sp, c)
                    for p, sp, c in zip(prompts, params_list, ctls)]
        try:
            while not all(r.finished for r in requests):
                self.engine.step()
        except BaseException:
            for r in requests:
                self.engine.cancel(r.request_id)
            raise
        results = []
        for r in requests:
            branches = self.engine.completions(r)
            branches[0].branches = branches
            results.append(branches[0])
            self.engine.release(r)
        return results

    def stream(self, prompt: str | list[dict], params: SamplingParams | None = None, *, chat: bool = False,
               controller=None, controller_arg: str | bytes = "", controller_limits=None) -> Iterator[Delta]:
        """Yield text deltas as they are decoded (`delta.branch` tells forks apart). Closing the
        iterator cancels the request. `controller`: a ready controller, a built-in name, a .wasm
        path or wasm bytes (with `controller_arg`)."""
        if controller is not None and not hasattr(controller, "mid_process"):
            controller = self.start_controller(controller, controller_arg, controller_limits)
        req = self.engine.add_request(self.prompt_text(prompt, chat), params, controller)
        try:
            while not req.finished:
                for delta in self.engine.step():
                    if delta.request_id == req.request_id:
                        if delta.finished and req.spec_stats is not None:
                            delta.speculative = req.spec_stats.as_dict(sum(s.num_output for s in req.seqs))
                        yield delta
        finally:
            if not req.finished:
                self.engine.cancel(req.request_id)
            self.engine.release(req)
