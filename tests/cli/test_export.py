"""`localpd export` from the command line: bad input is one line and a non-zero exit."""

import pytest

from localpd.cli.main import main


def run(capsys, *argv) -> tuple[int, str]:
    rc = main(["export", *argv])
    return rc, capsys.readouterr().err


def test_a_scheme_the_format_cannot_hold_names_the_formats_that_can(capsys, tmp_path):
    rc, err = run(capsys, "smollm2-135m", "--format", "compressed-tensors", "--quant", "bnb-nf4", "-o",
                  str(tmp_path / "out"))
    assert rc == 1 and err == "localpd: error: compressed-tensors cannot hold bnb-nf4 weights; formats that can: gguf\n"
    assert not (tmp_path / "out").exists()


def test_an_existing_output_is_refused_before_the_model_loads(capsys, tmp_path):
    out = tmp_path / "m.gguf"
    out.write_bytes(b"mine")
    rc, err = run(capsys, "no-such-model", "--format", "gguf", "-o", str(out))
    assert rc == 1 and err == f"localpd: error: {out} exists; choose another path or pass --force to replace it\n"
    assert out.read_bytes() == b"mine"


def test_an_unknown_format_is_an_argument_error(capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        main(["export", "smollm2-135m", "--format", "onnx", "-o", str(tmp_path / "x")])
    assert e.value.code == 2 and len(capsys.readouterr().err.splitlines()) == 1

