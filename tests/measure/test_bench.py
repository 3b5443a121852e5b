"""`localpd bench` on the CPU: the table, the JSON and the roofline PNG, on the real model and on synthetic shapes."""

import json

import torch

from localpd.cli.main import main
from localpd.engine import Engine
from localpd.model.transformer import Transformer
from localpd.load.synthetic import SYNTHETIC, matrix_shapes, synthetic_model, synthetic_nbytes
from localpd.engine.sampling import SamplingParams


def test_bench_prints_the_table_and_writes_json_and_png(default_gguf, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("LOCALPD_HOME", str(tmp_path))
    out_json, out_png = tmp_path / "b.json", tmp_path / "b.png"
    assert main(["bench", str(default_gguf), "--prompt-len", "16,40", "--batch", "1,2", "--gen-len", "6",
                 "--json", str(out_json), "--plot", str(out_png)]) == 0
    text = capsys.readouterr().out
    assert "decode tok/s" in text and "MBU" in text and "measured" in text
    data = json.loads(out_json.read_text())
    points = data["points"]
    assert [(p["prompt_len"], p["batch"]) for p in points] == [(16, 1), (16, 2), (40, 1), (40, 2)]
    for p in points:
        assert p["decode_tps"] > 0 and p["prefill_tps"] > 0 and 0 < p["decode_mbu"] < 1.5
        assert p["ceiling_tps"] > p["decode_tps"] * 0.5
    assert data["device"]["measured_bandwidth"] > 0
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_synthetic_bench_runs_and_oversized_models_are_skipped(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("LOCALPD_HOME", str(tmp_path))
    assert main(["bench", "--synthetic", "smollm2-135m", "--quant", "int8", "--prompt-len", "8", "--gen-len", "3"]) == 0
    assert "synthetic:smollm2-135m" in capsys.readouterr().out
    monkeypatch.setattr("os.sysconf", lambda name: 1024)  # pretend the machine has almost no memory
    assert main(["bench", "--synthetic", "llama3-8b", "--quant", "int4-g128"]) == 0
    assert "skipped" in capsys.readouterr().out


def test_synthetic_shapes_follow_the_config_and_run():
    c = SYNTHETIC["qwen2.5-0.5b"]
    loaded = synthetic_model("qwen2.5-0.5b", "int4-g32", torch.float32, "cpu")
    for name, shape in matrix_shapes(c).items():
        assert tuple(loaded.weights[name].shape) == shape
    assert loaded.weights["layers.0.q_proj.bias"].shape == (c.n_heads * c.head_dim,)
    model = Transformer(loaded.config, loaded.weights)
    nbytes = synthetic_nbytes("qwen2.5-0.5b", "int4-g32")
    assert abs(model.body_bytes + model.lm_head.nbytes - nbytes) / nbytes < 0.01


def test_engine_runs_a_synthetic_model_without_a_tokenizer():
    engine = Engine("synthetic:smollm2-135m", device="cpu", quant="int8", max_context=64)
    events = list(engine.generate([1, 2, 3], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)))
    assert len(events) == 4 and events[-1].finish_reason == "length" and engine.tokenizer is None
    engine.close()


def test_bench_kernels_without_a_gpu_runs_the_cpu_path_and_says_so(tmp_path, capsys):
    out = tmp_path / "k.json"
    assert main(["bench", "kernels", "--m", "1", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "no GPU" in text and "tinygemm int4-g128: n/a (GPU only)" in text
    rows = json.loads(out.read_text())["rows"]
    assert [r["shape"] for r in rows] == ["qkv", "o", "gate_up", "down", "lm_head"]
    # localpd's CPU kernels round each block of 32 inputs to two int8 levels: ~1e-5 from the fp32 reference
    assert all(r["rel_err"]["int8"] < 1e-4 and r["cells"]["int4-g128"][0] > 0 for r in rows)
    assert "CPU path: localpd kernels" in text


def test_bench_kernels_writes_no_tinygemm_table_without_a_gpu(tmp_path, capsys):
    """The table says where tinygemm ran faster on a card (kernels/tinygemm.py): the CPU measures no card."""
    out = tmp_path / "t.json"
    assert main(["bench", "kernels", "--device", "cpu", "--tinygemm-table", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--tinygemm-table needs a GPU" in err and not out.exists()


def test_a_chained_benchmark_counts_one_token_a_pass(default_gguf, monkeypatch):
    """A decode step that chains 4 steps (Engine._chain) writes 4 tokens in 4 passes over the weights: the bench
    point's tokens a pass stay 1 at batch 1 and 2, not the tokens a step."""
    import localpd.engine.engine as engine_module
    from localpd.measure.bench import run_point
    from localpd.measure.device import DeviceInfo

    monkeypatch.setattr(engine_module, "CHAIN_SECONDS", float("inf"))  # chains whatever a CPU step takes
    info = DeviceInfo("cpu", "cpu", 50e9, "table", 20e9, "measured", None, "unknown")
    engine = Engine(default_gguf, device="cpu", max_context=256, decode_chain=4)
    try:
        for batch in (1, 2):
            point = run_point(engine, info, 16, batch, 13, seed=batch)  # 12 decode tokens a reply: three chains
            assert point.tokens_per_pass == 1.0 and point.decode_tps > 0
    finally:
        engine.close()


def test_a_prompt_prefilled_in_chunks_counts_every_chunk(default_gguf):
    """A prompt longer than a step's token budget is prefilled in chunks, and only the last one samples a token (an
    event): the bench point's prefill counts every chunk's time and FLOPs (GenerationStats.prefill_steps), as one
    step's prefill of the same prompt does, where it counted the last chunk alone (prefill tok/s at 1024 tokens
    read 148 where the prompt took 80 a second)."""
    from localpd.measure.bench import run_point
    from localpd.measure.device import DeviceInfo

    info = DeviceInfo("cpu", "cpu", 50e9, "table", 20e9, "measured", None, "unknown")
    flops = {}
    for budget in (16, 256):
        engine = Engine(default_gguf, device="cpu", max_context=256, max_step_tokens=budget)
        try:
            point = run_point(engine, info, 40, 1, 2, seed=3)  # 16 + 16 + 8 tokens, or one step
            handle = engine.submit(list(range(1, 41)), SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
            list(handle)
        finally:
            engine.close()
        steps = handle.stats.prefill_steps
        assert [s.tokens for s in steps] == ([16, 16, 8] if budget == 16 else [40])
        flops[budget] = point.prefill_flops_per_s * 40 / point.prefill_tps  # the point's prefill FLOPs
    assert abs(flops[16] / flops[256] - 1) < 0.02
