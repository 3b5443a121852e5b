"""`localpd bench kernels --predict ...` run as a command for the prediction tests: the test process has Triton's
interpreter switched on, and interpreted kernels cannot be compiled for a GPU."""

import json
import os
import subprocess
import sys


def predict_rows(tmp_path_factory, *args: str, printed: str = "instr/word") -> list[dict]:
    """The JSON rows of `localpd bench kernels --predict --cards H100` with these arguments; its table printed
    `printed`."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "LOCALPD_TRITON_INTERPRET")}
    path = tmp_path_factory.mktemp("predict") / "rows.json"
    done = subprocess.run([sys.executable, "-m", "localpd.cli.main", "bench", "kernels", "--predict", "--cards",
                           "H100", *args, "--json", str(path)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert printed in done.stdout
    return json.loads(path.read_text())["rows"]
