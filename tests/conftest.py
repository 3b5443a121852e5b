import os
from pathlib import Path

# Triton decides interpreter or compiler when it is first imported (bitsandbytes imports it at collection), so
# the CPU test session switches the interpreter on before any test module loads; the app's CPU path still runs
# the torch references unless LOCALPD_TRITON_INTERPRET asks for the kernels.
if os.environ.get("LOCALPD_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def _installed_packages_over_the_repositorys_folders() -> None:
    """The repository's kernels/ folder (installed as localpd.kernels) would stand for Hugging Face's `kernels`
    package, which transformers imports where that is installed (transformers 5.25 brings it), because pytest puts
    the repository's root on sys.path: the installed package is imported first, from the other paths, so that
    sys.modules holds it."""
    import importlib
    import importlib.util
    import sys

    root = Path(__file__).resolve().parents[1]
    saved = sys.path[:]
    sys.path[:] = [p for p in saved if Path(p or ".").resolve() != root]
    try:
        if "kernels" not in sys.modules and importlib.util.find_spec("kernels") is not None:
            importlib.import_module("kernels")
    finally:
        sys.path[:] = saved


_installed_packages_over_the_repositorys_folders()

# the real default model or transformers; kernels compiled for an NVIDIA GPU in a process of its own
SLOW_FIXTURES = {"default_gguf", "engine", "hf_reference", "served", "sass_table"}
INTERPRETED = {"test_kernels.py", "test_kv_write.py", "test_decode_attention.py", "test_prefill_attention.py",
               "test_fused_kernels.py"}  # Triton's kernels, interpreted
COMPILED = {"test_attention_compile.py"}  # kernels compiled for NVIDIA cards (scripts/compile_check.py, sass_table)


# The files that take longest, longest first, by their CPU seconds at one thread in a fresh home (no Triton cache:
# the kernels compiled for NVIDIA cards are compiled anew, as on CI), after the fifth pass's changes (docs/PERF.md,
# "Test suite time, fifth pass"); files that need llama.cpp's tools (skipped on CI) by what CI runs of them.
# pyproject's addopts hand each file to one of two processes; these go out first and the rest after them in their
# own order, so that the two processes end together. xdist's own order (most tests first) handed out the files of a
# few long tests (the schemathesis run, the serve-shutdown signals) last. quant/test_schemes.py goes with
# model/test_model.py and load/test_loader.py (TOGETHER).
LONGEST_FILES = ("kernels/test_attention_compile.py", "api/test_server.py", "quant/test_schemes.py",
                 "engine/test_engine.py", "kernels/test_kv_write.py", "cli/test_cli.py", "kernels/test_kernels.py",
                 "api/test_ollama.py", "engine/test_draft_model.py", "kernels/test_fused_kernels.py",
                 "quantize/test_calibrate.py", "api/test_server_fuzz.py", "engine/test_speculate_engine.py",
                 "model/test_cpu_fidelity.py", "kernels/test_prefill_attention.py", "kernels/test_gemv_dp4a.py",
                 "export/test_compressed_tensors.py", "quantize/test_quantize.py", "kernels/test_decode_attention.py",
                 "api/test_clients.py", "kernels/test_cpu_kernels.py", "kernels/test_gemv_kmajor.py",
                 "api/test_responses.py", "measure/test_predict.py", "api/test_models.py", "tui/test_tui.py")

# Files that share a costly session fixture go to one process, so that it is built once: transformers' model of the
# default GGUF (hf_reference, some 13 s of CPU to dequantize). Each is handed out with the first of its group.
TOGETHER = {"model/test_model.py": "quant/test_schemes.py", "load/test_loader.py": "quant/test_schemes.py"}


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """pyproject's --dist loadfile, with the files of TOGETHER each in its group's work unit."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    together = {f"tests/{name}": f"tests/{group}" for name, group in TOGETHER.items()}

    class GroupedFiles(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            return together.get(scope, scope)

    return GroupedFiles(config, log)


def pytest_collection_modifyitems(items):
    """A test that loads the real default model or transformers, or compiles kernels for a GPU (one of
    SLOW_FIXTURES, directly or through another fixture), or runs the GEMV, attention and fused kernels under
    Triton's interpreter, is slow: `pytest -m "not slow"` runs the rest, `pytest` everything. The files of
    LONGEST_FILES come first."""
    for item in items:
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())) or item.path.name in INTERPRETED | COMPILED:
            item.add_marker(pytest.mark.slow)
    rank = {Path(__file__).parent / name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path, len(rank)))  # stable: the other files keep their order
    if os.environ.get("TRITON_INTERPRET") == "1" and any(item.path.parent.name == "kernels" for item in items):
        try:
            from triton.runtime import interpreter
        except ImportError:  # no Triton here: nothing to interpret
            return
        interpret_without_dead_work(interpreter)


def pytest_configure(config):
    """Under pytest-xdist (pyproject's addopts run two worker processes), each worker takes its share of torch's
    threads, which localpd's CPU kernels use too, so that two workers running models at once do not fight over
    the same cores. The processes a test starts take the same share (localpd's commands and the scripts through
    OMP_NUM_THREADS, llama.cpp's tools at -t torch.get_num_threads()): at the machine's thread count their threads
    wait for a core the other worker holds, and llama.cpp's and OpenMP's waiting threads spin (llama-server's four
    greedy replies in the fp32 export test: 16.6-18.9 s of CPU at -t 2 beside other work, 1.9 at -t 1; docs/PERF.md).
    Files are handed out in the order pytest_collection_modifyitems leaves them, not by xdist's count of their
    tests."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch

        torch.set_num_threads(max(1, torch.get_num_threads() // workers))
        os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))  # localpd's commands read it


def interpret_without_dead_work(interpreter) -> None:
    """Work Triton's interpreter (3.9) does for nothing, left out (docs/PERF.md, "Test suite time, fifth pass": a
    kernel test under it in half the CPU time); what the kernels compute and what is checked stay. Where a Triton
    release changed what this relies on, it is left as it is.

    - It swaps triton.language's functions for its own at each launch (GridExecutor) and again at each call of a
      @triton.jit helper inside a program (InterpretedFunction.__call__), where the launch's swap already holds: the
      helper's swap finds nothing left to swap, and its inspect.getmembers walks over the language cost 0.8 ms a
      call. A helper whose language modules the launch swapped skips it.
    - Its integer add, sub and mul redo each operation in int64 and compare the result with the type's range
      (sanitize_overflow), then hand the comparison to device_assert, which asserts nothing unless the interpreter's
      options say debug, and they do not: the options keep debug off and the overflow work goes."""
    from dataclasses import fields, is_dataclass, replace

    from triton import language as tl

    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    needs = ("_patch_lang", "_LangPatchScope", "GridExecutor")
    if getattr(interpreter, "without_dead_work", False) or not all(hasattr(interpreter, n) for n in needs) \
            or not is_dataclass(options) or "sanitize_overflow" not in {f.name for f in fields(options)}:
        return
    if not builder.options.debug:  # else the overflow checks assert, and stay
        builder.options = replace(builder.options, sanitize_overflow=False)
    swap, launch, launches = interpreter._patch_lang, interpreter.GridExecutor.__call__, []

    def languages(fn) -> set[int]:
        return {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}

    def swap_unless_swapped(fn):
        if launches and launches[-1] is not None and languages(fn) <= launches[-1]:
            return interpreter._LangPatchScope()  # nothing swapped, nothing to restore
        scope = swap(fn)
        if launches:  # the launch's own swap, or a helper's of a module more (standard.py's tl.max sees tl.core),
            launches[-1] = (launches[-1] or set()) | languages(fn)  # which Triton never restores: it holds
        return scope

    def launch_once(self, *args, **kwargs):
        launches.append(None)
        try:
            return launch(self, *args, **kwargs)
        finally:
            launches.pop()

    interpreter._patch_lang, interpreter.GridExecutor.__call__ = swap_unless_swapped, launch_once
    interpreter.without_dead_work = True


@pytest.fixture
def sass_table():
    """run(script, *args): the rows of a SASS-counting script's table (scripts/gemv_sass.py, attention_sass.py),
    each split into fields. The script compiles kernels for an NVIDIA architecture on this CPU, so it runs in a
    process of its own without the Triton interpreter."""
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia")

    def run(script: str, *args: str) -> list[list[str]]:
        env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "LOCALPD_TRITON_INTERPRET")}
        out = subprocess.run([sys.executable, str(Path(__file__).parent.parent / "scripts" / script), *args],
                             capture_output=True, text=True, env=env, timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
        return [line.split() for line in out.stdout.splitlines() if line.split()[:1] and line.split()[0].isdigit()]

    return run


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    """Path of the embedded default model (SmolLM2-135M-Instruct Q4_1 GGUF), pulled once."""
    env = os.environ.get("LOCALPD_TEST_GGUF")
    if env:
        return Path(env)
    from localpd.load.registry import resolve_model

    return resolve_model("smollm2-135m").path


@pytest.fixture(scope="session")
def llama_quantize() -> Path:
    """llama.cpp's llama-quantize, as /work/shared/peers/llama-cpp.sh builds it (LOCALPD_LLAMA_BIN: its folder); the
    test is skipped where it is not built."""
    folders = [Path(os.environ["LOCALPD_LLAMA_BIN"])] if os.environ.get("LOCALPD_LLAMA_BIN") else \
        sorted(Path.home().glob(".cache/localpd-peers/llama.cpp-*/build/bin"))
    tool = next((f / "llama-quantize" for f in folders if (f / "llama-quantize").is_file()), None)
    if tool is None:
        pytest.skip("llama.cpp's llama-quantize is not built (bash /work/shared/peers/llama-cpp.sh builds it, or set "
                    "LOCALPD_LLAMA_BIN to its folder)")
    return tool


@pytest.fixture(scope="session")
def hf_reference(default_gguf):
    """transformers' own model and tokenizer for the same GGUF: the test-only reference."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = dict(gguf_file=default_gguf.name)
    tok = AutoTokenizer.from_pretrained(default_gguf.parent, **kw)
    model = AutoModelForCausalLM.from_pretrained(default_gguf.parent, torch_dtype=torch.float32, **kw).eval()
    return model, tok


@pytest.fixture(scope="session")
def engine(default_gguf):
    """The default model on the reference path (fp32 weights, exactly the file's values dequantized; fp32
    activations), which the tests hold to transformers' logits. The CPU's default scheme (native, on localpd's CPU
    kernels) is held to this path in tests/model/test_cpu_fidelity.py."""
    from localpd.engine import Engine

    return Engine(default_gguf, device="cpu", max_context=2048, quant="fp32")
