"""`localpd serve [MODEL ...]`'s models (localpd.cli.serve.model_pool): each named one served under its id; a name
that is neither a registry model nor a file is a one-line error before anything loads."""

import subprocess
import sys

from localpd.cli.main import build_parser
from localpd.cli.serve import model_pool


def test_each_model_named_is_served_under_its_id_and_none_is_loaded_yet(tmp_path):
    gguf = tmp_path / "my-model.Q8_0.gguf"
    gguf.write_bytes(b"GGUF")
    folder = tmp_path / "hf-model"
    folder.mkdir()
    args = build_parser().parse_args(["serve", "smollm2-135m", str(gguf), str(folder), "--max-loaded", "2",
                                      "--memory", "2GiB", "--keep-alive", "1h30m"])
    pool = model_pool(args)
    try:
        assert list(pool.models) == ["smollm2-135m", "my-model.Q8_0", "hf-model"]
        assert pool.max_loaded == 2 and pool.memory == 2 * 2**30 and pool.keep_alive == 5400
        assert pool.models["my-model.Q8_0"].size == 4 and pool.loaded() == []
    finally:
        pool.close()


def test_an_unknown_model_or_keep_alive_is_a_one_line_error():
    for argv, code, fragment in ((["no-such-model"], 1, "neither a registry model"),
                                 (["--keep-alive", "soon"], 2, "--keep-alive must be a duration")):
        r = subprocess.run([sys.executable, "-m", "localpd.cli", "serve", *argv], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == code and fragment in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
