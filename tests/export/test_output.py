"""An export's output path: an existing one refused unless forced; an interrupted write leaves nothing under the
final name, and a forced one that is interrupted leaves the old file as it was."""

import pytest

from localpd.errors import LocalpdError
from localpd.export.output import write_replacing


def write_half_then(stop):
    def write(tmp):
        tmp.write_bytes(b"GGUF" + b"\0" * 1000)  # part of a file
        raise stop
    return write


def test_an_existing_path_is_refused_unless_forced(tmp_path):
    out = tmp_path / "m.gguf"
    out.write_bytes(b"old")
    with pytest.raises(LocalpdError, match="exists; choose another path or pass --force"):
        write_replacing(out, False, lambda tmp: tmp.write_bytes(b"new"))
    assert out.read_bytes() == b"old"
    write_replacing(out, True, lambda tmp: tmp.write_bytes(b"new"))
    assert out.read_bytes() == b"new" and [p.name for p in tmp_path.iterdir()] == ["m.gguf"]


@pytest.mark.parametrize("stop", [KeyboardInterrupt(), OSError(28, "No space left on device")])
def test_an_interrupted_write_leaves_no_partial_file(tmp_path, stop):
    out = tmp_path / "m.gguf"
    with pytest.raises(type(stop)):
        write_replacing(out, False, write_half_then(stop))
    assert list(tmp_path.iterdir()) == []
    out.write_bytes(b"old")
    with pytest.raises(type(stop)):
        write_replacing(out, True, write_half_then(stop))
    assert out.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["m.gguf"]


def test_a_directory_replaces_a_directory(tmp_path):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "stale.txt").write_text("x")

    def write(tmp):
        tmp.mkdir()
        (tmp / "config.json").write_text("{}")

    write_replacing(out, True, write)
    assert [p.name for p in out.iterdir()] == ["config.json"]
