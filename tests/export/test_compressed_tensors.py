"""compressed-tensors export of the real default model: the package decompresses what was written to localpd's
weights (exactly where the format holds them: int8, and int4 with integer zero points, the int4-zp schemes), and
transformers loads the directory on the CPU and answers with localpd's greedy tokens."""

import json
from dataclasses import asdict

import pytest
import torch
from safetensors import safe_open

from localpd.cli.export import export_model
from localpd.cli.main import main
from localpd.export.compressed_tensors import hf_name, quantization
from localpd.load.loader import load_model
from localpd.model.transformer import Transformer
from localpd.export.source import tokenizer_meta
from localpd.quant.schemes import int4_group
from localpd.quant.store import save_quantized
from localpd.quant.weights import Int4Weight, Int8Weight, pack_int4

pytest.importorskip("compressed_tensors")


def decompress_all(out) -> dict[str, torch.Tensor]:
    """Every quantized matrix of the directory, decompressed by the package as its quantization_config says."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig

    config = QuantizationConfig.model_validate(json.loads((out / "config.json").read_text())["quantization_config"])
    assert config.format == "pack-quantized" and config.quantization_status == "compressed"
    weights = {}
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        for scheme in config.config_groups.values():
            for name in scheme.targets:
                state = {k.rsplit(".", 1)[1]: f.get_tensor(k) for k in keys if k.rsplit(".", 1)[0] == name}
                weights[name] = PackedQuantizationCompressor.decompress(state, scheme)["weight"]
    return weights


@pytest.fixture(scope="module")
def int8(default_gguf, tmp_path_factory):
    out = tmp_path_factory.mktemp("ct") / "smollm2-int8"
    report = export_model(str(default_gguf), "compressed-tensors", out, quant="int8")
    return out, report, load_model(default_gguf, scheme="int8")


@pytest.fixture(scope="module")
def int4_zp(default_gguf, tmp_path_factory):
    """The default model's matrices in int4-zp-g64, saved as `localpd quantize` saves a model and exported from that
    directory as it is. Rounded to nearest (quantize_rtn): the scheme's clipping search over the whole model takes
    minutes of CI's CPU, and the export holds the format, whichever search filled it (tests/quant test the search).
    g64, not g128: g128 takes groups of 64 where the input (576) is not a multiple of 128, and transformers 5.24
    applies one config group's group size to every layer (docs/PERF.md)."""
    base = tmp_path_factory.mktemp("ct")
    dense = load_model(default_gguf, scheme="fp32")
    weights = {k: Int4Weight.quantize_rtn(w, int4_group("int4-zp-g64", w.shape[1]), integer_zero=True)
               if k.endswith("_proj") else w for k, w in dense.weights.items()}
    quantized = save_quantized(base / "smollm2-int4-zp-g64", weights, asdict(dense.config), "int4-zp-g64",
                               {"name": "smollm2-135m"}, tokenizer_meta=tokenizer_meta(dense))
    out = base / "smollm2-int4-zp-export"
    return out, export_model(str(quantized), "compressed-tensors", out), load_model(quantized)


def test_int8_decompresses_to_exactly_localpds_weights(int8):
    out, report, loaded = int8
    assert not report.lossy
    matrices = {k: w for k, w in loaded.weights.items() if isinstance(w, Int8Weight) and k != "embed_tokens"}
    decompressed = decompress_all(out)
    assert len(decompressed) == len(matrices) == 210
    for key, w in matrices.items():
        assert torch.equal(decompressed[hf_name(key)], w.dequantize()), key
    cfg = json.loads((out / "config.json").read_text())
    args = cfg["quantization_config"]["config_groups"]["group_0"]["weights"]
    assert (args["num_bits"], args["strategy"], args["symmetric"]) == (8, "channel", True)


def test_localpd_refuses_to_run_or_export_an_export_for_vllm_in_one_line(int8, tmp_path):
    """The directory's tensors are packed for another engine (weight_packed, weight_scale): loading it for chat or
    for a GGUF export says so, where it failed on a missing tensor or a KeyError."""
    from localpd.errors import LocalpdError

    out = int8[0]
    with pytest.raises(LocalpdError, match="holds weights quantized by compressed-tensors"):
        load_model(out)
    with pytest.raises(LocalpdError, match="holds weights quantized by compressed-tensors"):
        export_model(str(out), "gguf", tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()


def test_int4_with_integer_zero_points_decompresses_to_exactly_localpds_weights(int4_zp):
    """Every int4-zp matrix is asymmetric int4 in compressed-tensors as it is: the package decompresses the file
    to localpd's dequantized weights bit for bit."""
    out, report, loaded = int4_zp
    assert not report.lossy and not report.notes
    matrices = {k: w for k, w in loaded.weights.items() if isinstance(w, Int4Weight)}
    decompressed = decompress_all(out)
    assert len(decompressed) == len(matrices) == 210
    for key, w in matrices.items():
        assert torch.equal(decompressed[hf_name(key)], w.dequantize()), key
    groups = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"].values()
    args = sorted((g["weights"]["group_size"], g["weights"]["symmetric"], len(g["targets"])) for g in groups)
    assert args == [(64, False, 210)]


def transformers_greedy(out, messages: list[dict], ids: list[int], n: int) -> list[int]:
    """transformers' greedy tokens after ids from the directory, loaded on the CPU, its chat template checked to
    give ids."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, CompressedTensorsConfig

    # dequantize at load: transformers 5 + compressed-tensors 0.20 size an asymmetric matrix's packed zero points
    # unpacked when they build the compressed model, so the package's own decompression it is
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                 quantization_config=CompressedTensorsConfig(dequantize=True)).eval()
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False) == ids
    with torch.no_grad():
        return model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)[0, len(ids):].tolist()


@pytest.mark.parametrize("export", ["int8", "int4_zp"])
def test_transformers_loads_it_on_the_cpu_and_answers_with_localpds_greedy_tokens(export, request, greedy_path):
    """int8 per channel, and int4-zp-g64 (asymmetric int4, the zero points packed): transformers runs the weights
    localpd runs, and its greedy tokens are localpd's, on a prompt without near-ties."""
    out, _, loaded = request.getfixturevalue(export)
    messages = [{"role": "user", "content": "Name three primary colors." if export == "int8" else
                 "What is the capital of France?"}]
    ours = loaded.tokenizer()
    ids = ours.encode(ours.render_chat(messages))
    theirs = transformers_greedy(out, messages, ids, 16)
    dense = {k: w if isinstance(w, torch.Tensor) else w.dequantize() for k, w in loaded.weights.items()}
    expected, margins = greedy_path(Transformer(loaded.config, dense), ids, 16, set(ours.eos_ids))
    assert len(expected) >= 8 and min(margins) > 0.01, margins  # no tie that float32 summation order could tip
    assert [t for t in theirs if t not in ours.eos_ids] == expected


def test_a_q4_1_file_exports_lossy_and_the_export_says_what_is_exact(default_gguf, tmp_path, capsys):
    """The native (Q4_1) export: its groups' float zero points have no exact form, so every int4 matrix is
    re-quantized (the loss is in docs/PERF.md), and the command says so and names what exports exactly."""
    out = tmp_path / "smollm2-int4"
    assert main(["export", str(default_gguf), "--format", "compressed-tensors", "-o", str(out)]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0].endswith("62 exact") and err[1].startswith("210 re-quantized: relative error mean")
    assert err[2].startswith("210 int4 matrices have float zero points") and "--scheme int4-zp-g128" in err[2]
    assert (out / "config.json").is_file()


def test_int4_with_float_biases_takes_integer_zero_points_with_the_loss_measured(default_gguf):
    """The Q4_1 file's groups (float16 scale and min) as asymmetric int4 in groups of 32, as the package packs and
    decompresses them: within 10% of localpd's weights (relative RMS), and nearer than the nearest zero point with
    the scale kept. The groups whose min is a whole number of scales (0.27% of the model's) come back exactly:
    pack-quantized's zero point is an integer, so only there does one hold the min."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    loaded = load_model(default_gguf)
    exact_groups = 0
    for key in ("layers.0.q_proj", "layers.17.up_proj", "layers.29.down_proj"):
        w = loaded.weights[key]
        args, state = quantization(w)
        assert args == {"num_bits": 4, "strategy": "group", "group_size": 32, "symmetric": False}
        scheme = QuantizationScheme(targets=[key], weights=QuantizationArgs(type="int", **args))
        packed = PackedQuantizationCompressor.compress(state, scheme)
        assert packed["weight_zero_point"].dtype == torch.int32  # integer zero points, packed 8 to a word
        decoded = PackedQuantizationCompressor.decompress(packed, scheme)["weight"]
        values, scale, bias = w.dequantize(), w.scales.float(), w.biases.float()
        zero = (torch.round(-bias / scale) - 8).clamp(-8, 7)[..., None]
        g = values.reshape(*scale.shape, 32)
        nearest = ((torch.round(g / scale[..., None] + zero).clamp(-8, 7) - zero) * scale[..., None]).reshape_as(values)
        err, err_nearest = (decoded - values).norm() / values.norm(), (nearest - values).norm() / values.norm()
        assert 0 < err < 0.1 and err < 0.95 * err_nearest, (key, err, err_nearest)
        ratio = bias / scale
        whole = (ratio == torch.round(ratio)) & (ratio >= -15) & (ratio <= 0)
        same = (decoded.reshape_as(g) == g).all(-1)
        assert torch.equal(same & whole, whole), key
        exact_groups += int(whole.sum())
    assert exact_groups > 0


def test_int4_whose_biases_are_minus_eight_scales_is_symmetric_and_exact():
    """A Q4_0 file's groups ((q - 8) * d) need no zero point: symmetric int4, decompressed exactly."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (64, 128), generator=g, dtype=torch.uint8)
    scales = (torch.rand(64, 4, generator=g) * 0.01 + 1e-3).half()
    w = Int4Weight(pack_int4(codes), scales, (-8 * scales.float()).half())
    args, state = quantization(w)
    assert args == {"num_bits": 4, "strategy": "group", "group_size": 32, "symmetric": True}
    scheme = QuantizationScheme(targets=["x"], weights=QuantizationArgs(type="int", **args))
    packed = PackedQuantizationCompressor.compress(state, scheme)
    assert "weight_zero_point" not in packed
    assert torch.equal(PackedQuantizationCompressor.decompress(packed, scheme)["weight"], w.dequantize())


def test_int4_whose_biases_are_whole_numbers_of_scales_is_asymmetric_and_exact():
    """Groups value = (code - k) * scale for a whole k in 0..15 per group: integer zero points hold them, and the
    package decompresses them to exactly localpd's values."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (64, 128), generator=g, dtype=torch.uint8)
    scales = (torch.randint(16, 128, (64, 4), generator=g) * 2.0 ** -14).half()  # 7 bits: k * scale is a float16
    k = torch.randint(0, 16, (64, 4), generator=g)
    w = Int4Weight(pack_int4(codes), scales, (-k * scales.float()).half())
    assert torch.equal(w.biases.float() / w.scales.float(), -k.float()) and (k != 8).any()
    args, state = quantization(w)
    assert args == {"num_bits": 4, "strategy": "group", "group_size": 32, "symmetric": False}
    scheme = QuantizationScheme(targets=["x"], weights=QuantizationArgs(type="int", **args))
    packed = PackedQuantizationCompressor.compress(state, scheme)
    assert torch.equal(PackedQuantizationCompressor.decompress(packed, scheme)["weight"], w.dequantize())
