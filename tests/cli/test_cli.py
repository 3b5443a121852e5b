"""`localpd` as a user runs it: subprocesses, real model, real terminal for the REPL. The error paths run the same
`main()` in this process (`localpd_here`): a fresh process each would add its start-up (some 3 s on CI's cores)
to a check that needs none."""

import io
import json
import os
import subprocess
import sys

import pexpect
import pytest

PARIS = ["chat", "smollm2-135m", "What is the capital of France?", "--temperature", "0", "--max-tokens", "48"]


def localpd(args, env=None, stdin=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "localpd.cli", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, input=stdin, timeout=timeout)


def localpd_here(args, capfd, stdin=None) -> subprocess.CompletedProcess:
    """`localpd ARGS` run in this process, as `python -m localpd.cli` runs it (`sys.exit(main())`): its exit status
    (argparse's SystemExit included) and what it wrote. torch's threads, which main() sets, are put back after."""
    import torch

    from localpd.cli.main import main

    threads, saved_stdin = torch.get_num_threads(), sys.stdin
    capfd.readouterr()
    try:
        if stdin is not None:
            sys.stdin = io.StringIO(stdin)
        try:
            code = main(list(args))
        except SystemExit as e:
            code = e.code
    finally:
        sys.stdin = saved_stdin
        torch.set_num_threads(threads)
    out = capfd.readouterr()
    return subprocess.CompletedProcess(["localpd", *args], code, out.out, out.err)


def one_line_error(result, code=1):
    assert result.returncode == code, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


@pytest.mark.slow  # pulls and runs the default model
def test_readme_command_answers_paris_from_an_empty_cache(tmp_path):
    env = {"LOCALPD_HOME": str(tmp_path / "localpd"), "HF_HOME": str(tmp_path / "hf")}
    r = localpd(PARIS, env=env)
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "Traceback" not in r.stderr


def test_piped_stdin_answers_once_with_the_reply_alone(default_gguf):
    r = localpd(["chat", str(default_gguf), "--temperature", "0", "--max-tokens", "16"],
                stdin="What is the capital of France?\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().startswith("The capital of France is Paris")


def test_format_json_answers_with_one_json_object(default_gguf):
    r = localpd(["chat", str(default_gguf), "What is the capital of France?", "--format", "json", "--temperature",
                 "0", "--max-tokens", "64"])  # without --format json the answer is a sentence
    assert r.returncode == 0, r.stderr
    assert isinstance(json.loads(r.stdout), dict)


def test_format_takes_a_json_schema_file(default_gguf, tmp_path, capfd):
    schema = tmp_path / "city.json"
    schema.write_text(json.dumps({"type": "object", "required": ["city", "country"], "properties": {
        "city": {"type": "string"}, "country": {"type": "string"}}}))
    r = localpd(["chat", str(default_gguf), "What is the capital of France?", "--format", str(schema),
                 "--temperature", "0", "--max-tokens", "64"])
    assert r.returncode == 0, r.stderr
    assert set(json.loads(r.stdout)) == {"city", "country"}
    schema.write_text('{"type": "tuple"}')
    bad = localpd_here(["chat", str(default_gguf), "Hi", "--format", str(schema)], capfd)
    assert bad.returncode == 2 and "unknown JSON schema type" in bad.stderr and len(bad.stderr.splitlines()) == 1
    missing = localpd_here(["chat", str(default_gguf), "Hi", "--format", str(tmp_path / "none.json")], capfd)
    assert missing.returncode == 2 and "No such file" in missing.stderr


def test_embed_prints_one_unit_vector_a_line_as_the_engine_computes_it(default_gguf, engine, capfd):
    texts = ["Paris is the capital of France.", "Bananas are yellow."]
    r = localpd(["embed", str(default_gguf), *texts, "--ctx", "2048", "--quant", engine.quant])  # the same path
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(rows) == 2 and all(len(v) == engine.config.dim for v in rows)
    for row, text in zip(rows, texts):
        want = engine.embedding(engine.tokenizer.encode(text))
        assert max(abs(a - b) for a, b in zip(row, want)) < 1e-5
    piped = localpd(["embed", str(default_gguf), "--quant", engine.quant], stdin="\n".join(texts) + "\n")
    assert piped.returncode == 0
    again = [json.loads(line) for line in piped.stdout.splitlines()]  # the two may share a step or not: a tolerance
    assert len(again) == 2 and all(max(abs(a - b) for a, b in zip(u, v)) < 1e-5 for u, v in zip(again, rows))
    empty_line = localpd_here(["embed", str(default_gguf)], capfd, stdin="a\n\nb\n")
    assert "nothing to embed" in one_line_error(empty_line)
    too_long = localpd_here(["embed", str(default_gguf), "word " * 3000, "--ctx", "256"], capfd)
    assert "context" in one_line_error(too_long)


def test_regex_and_choice_hold_the_reply(default_gguf, capfd):
    r = localpd(["chat", str(default_gguf), "What is the capital of France?", "--regex", "The [a-z ]+ is [A-Z][a-z]+\\.",
                 "--temperature", "0", "--max-tokens", "24"])
    assert r.returncode == 0, r.stderr
    import re

    assert re.fullmatch(r"The [a-z ]+ is [A-Z][a-z]+\.", r.stdout.strip()), r.stdout
    picked = localpd(["chat", str(default_gguf), "Is Paris in France? Answer yes or no.", "--choice", "yes",
                      "--choice", "no", "--temperature", "0"])
    assert picked.returncode == 0 and picked.stdout.strip() in ("yes", "no"), picked.stderr
    assert "lookaround" in one_line_error(localpd_here(["chat", str(default_gguf), "Hi", "--regex", "(?=a)"], capfd),
                                          code=2)
    assert "not allowed with" in one_line_error(localpd_here(["chat", str(default_gguf), "Hi", "--regex", "a",
                                                              "--format", "json"], capfd), code=2)
    assert "must not be empty" in one_line_error(localpd_here(["chat", str(default_gguf), "Hi", "--choice", ""],
                                                              capfd), code=2)


def test_grammar_holds_the_reply(default_gguf, tmp_path, capfd):
    """--grammar FILE: a GBNF (or Lark) grammar; one the engine cannot take is a one-line error."""
    from pathlib import Path

    from localpd.constrain.grammar import Reader, text_grammar

    grammar = Path(__file__).parent.parent / "constrain" / "grammars" / "list.gbnf"
    r = localpd(["chat", str(default_gguf), "List three fruits.", "--grammar", str(grammar), "--temperature", "0",
                 "--max-tokens", "48"])
    assert r.returncode == 0, r.stderr
    reader = Reader(text_grammar(grammar.read_text()))
    assert reader.feed(r.stdout.rstrip("\n") + "\n") and reader.done, r.stdout
    bad = tmp_path / "bad.gbnf"
    bad.write_text('root ::= "a" root')
    assert "admits no string" in one_line_error(localpd_here(["chat", str(default_gguf), "Hi", "--grammar", str(bad)],
                                                             capfd), code=2)


def test_verbose_prints_timings(default_gguf):
    r = localpd(["chat", str(default_gguf), "Hi", "--temperature", "0", "--max-tokens", "8", "--verbose"])
    assert r.returncode == 0, r.stderr
    for key in ("prompt tokens", "time to first token", "prefill rate", "decode rate", "decode bandwidth",
                "decode ceiling"):
        assert key in r.stderr


def test_unknown_model_lists_known_ones(capfd):
    line = one_line_error(localpd_here(["chat", "no-such-model", "hi"], capfd))
    assert "unknown model" in line and "smollm2-135m" in line


def test_missing_file(tmp_path, capfd):
    assert "not found" in one_line_error(localpd_here(["chat", str(tmp_path / "missing.gguf"), "hi"], capfd))


def test_truncated_gguf(tmp_path, default_gguf, capfd):
    bad = tmp_path / "truncated.gguf"
    with open(default_gguf, "rb") as f:
        bad.write_bytes(f.read(5_000_000))
    assert str(bad) in one_line_error(localpd_here(["chat", str(bad), "hi"], capfd))


def test_not_a_gguf(tmp_path, capfd):
    bad = tmp_path / "junk.gguf"
    bad.write_bytes(b"this is not a model" * 100)
    one_line_error(localpd_here(["chat", str(bad), "hi"], capfd))


@pytest.mark.parametrize("option", [["--temperature", "hot"], ["--max-tokens", "0"], ["--device", "tpu"],
                                    ["--draft-tokens", "0"], ["--draft-tokens", "16"], ["--speculate", "eagle"]])
def test_bad_option_values_exit_2_with_one_line(option, default_gguf, capfd):
    one_line_error(localpd_here(["chat", str(default_gguf), "hi", *option], capfd), code=2)


def test_a_draft_model_of_another_vocabulary_is_a_one_line_error(default_gguf):
    line = one_line_error(localpd(["chat", str(default_gguf), "hi", "--draft", "synthetic:qwen2.5-0.5b"]))
    assert "vocabulary" in line and "synthetic:qwen2.5-0.5b" in line


def test_out_of_range_sampling_value(default_gguf, capfd):
    assert "top_p" in one_line_error(localpd_here(["chat", str(default_gguf), "hi", "--top-p", "5"], capfd))


def test_prompt_longer_than_the_context(default_gguf, capfd):
    line = one_line_error(localpd_here(["chat", str(default_gguf), "word " * 200, "--ctx", "64"], capfd))
    assert "context" in line


def test_repl_session(default_gguf):
    child = pexpect.spawn(sys.executable, ["-m", "localpd.cli", "chat", str(default_gguf), "--max-tokens", "24"],
                          encoding="utf-8", timeout=120, env={**os.environ, "TERM": "dumb"})
    child.expect(">>> ")
    child.sendline("/set temperature 0")
    child.expect("temperature = 0")
    child.sendline("/set top_p 7")
    child.expect("bad value for top_p")
    child.sendline("/set think off")  # SmolLM2's template has no thinking switch: the answer is the same
    child.expect("think = off")
    child.sendline("What is the capital of France?")
    child.expect("Paris")
    child.expect(">>> ")
    child.sendline('"""And what is')
    child.expect(r"\.\.\. ")
    child.sendline('the capital of Germany?"""')
    child.expect(">>> ")
    child.sendline("/stats")
    child.expect(r"prompt tokens:\s+\d+ \((\d+) cached\)")
    assert int(child.match.group(1)) > 20  # the second turn reused the first turn's KV cache
    child.sendline("/bye")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_ctrl_c_stops_a_reply_but_not_the_repl(default_gguf):
    """The REPL started with SIGINT ignored, as a suite or shell started in the background of a non-interactive
    shell passes it on (Python then installs no KeyboardInterrupt handler of its own): Ctrl+C still stops a reply."""
    import signal

    child = pexpect.spawn(sys.executable, ["-m", "localpd.cli", "chat", str(default_gguf), "--max-tokens", "2000",
                                           "--ctx", "4096"], encoding="utf-8", timeout=120,
                          env={**os.environ, "TERM": "dumb"},
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    child.expect(">>> ")
    child.sendline("Write a very long essay about the history of Europe.")
    child.expect("Europe.\r\n")  # the echo of the line typed
    child.expect(r"\w+ \w+ \w+")  # the reply is streaming
    child.sendintr()
    child.expect(">>> ")
    child.sendline("/bye")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_serve_answers_an_openai_client_until_stopped(default_gguf):
    """`localpd serve` as a user starts it: /health turns 200 once the model is loaded, an OpenAI client with the
    key gets an answer, a browser preflight from the --cors origin is answered, /metrics shows the --max-running
    limit, and SIGINT ends it cleanly."""
    import signal
    import socket
    import time

    import httpx
    import openai

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "localpd.cli", "serve", str(default_gguf), "--port", str(port),
                             "--api-key", "k", "--cors", "http://localhost:3000", "--ctx", "512", "--max-running", "3",
                             "--step-tokens", "96"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.1)
        client = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
        r = client.chat.completions.create(model=default_gguf.stem, messages=[{"role": "user", "content":
                                                                 "What is the capital of France?"}],
                                           temperature=0, max_tokens=16)
        assert "Paris" in r.choices[0].message.content
        preflight = httpx.options(url + "/v1/chat/completions", headers={
            "Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST"})
        assert preflight.headers.get("access-control-allow-origin") == "http://localhost:3000"
        metrics = httpx.get(url + "/metrics", headers={"Authorization": "Bearer k"}).text
        assert f'localpd_requests_running_max{{model="{default_gguf.stem}"}} 3.0\n' in metrics
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "Traceback" not in err, err[-2000:]


# each command and each bad value once (not all 16 pairs): the commands share one --threads option
# (cli.main.add_model_options)
@pytest.mark.parametrize("command,value", [("chat", "0"), ("serve", "-2"), ("bench", "two"), ("tui", "1.5")])
def test_threads_must_be_a_positive_whole_number(command, value, capfd):
    line = one_line_error(localpd_here([command, "--threads", value], capfd), code=2)
    assert "--threads" in line and ">= 1" in line


def test_threads_sets_torchs_threads_before_the_model_loads(default_gguf, monkeypatch):
    """In-process: --threads 1 is what torch (and the engine's own thread, where the CPU kernels read it) uses;
    without it, the physical cores this process may run on."""
    import threading

    import torch

    from localpd.cli.main import main
    from localpd.measure.device import physical_cores

    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    try:
        assert main(["chat", str(default_gguf), "Hi", "--threads", "1", "--temperature", "0", "--max-tokens", "4"]) == 0
        seen = []
        t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        t.start()
        t.join()
        assert torch.get_num_threads() == 1 and seen == [1]
        assert main(["chat", "no-such-model", "hi"]) == 1  # the default is set before loading fails
        assert torch.get_num_threads() == physical_cores()
    finally:
        torch.set_num_threads(before)


def test_models_shows_a_gguf_files_types_and_bits_per_weight(tmp_path):
    import gguf
    import numpy as np

    from localpd.cli.main import weight_types

    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_tensor("a.weight", np.zeros((2, 34), dtype=np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q8_0)  # 64 values
    w.add_tensor("b.weight", np.zeros((2, 34), dtype=np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("n.weight", np.ones(64, dtype=np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    assert weight_types(path) == f"{8 * (2 * 68 + 256) / 192:.2f} bpw: Q8_0 2, F32 1"
    path.write_bytes(path.read_bytes()[:-10])
    assert weight_types(path).startswith("unreadable: ") and "truncated" in weight_types(path)
    assert weight_types(None) == "-"
