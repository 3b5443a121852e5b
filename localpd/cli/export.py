"""`localpd export MODEL --format gguf|compressed-tensors -o PATH`: hand a model as localpd holds it to llama.cpp,
Ollama, vLLM or SGLang."""

from __future__ import annotations

import sys
from pathlib import Path

from localpd.export.output import check_output, write_replacing
from localpd.export.report import ExportReport
from localpd.export.source import check_format, load_source


def export_model(model: str, fmt: str, out: Path, quant: str | None = None, force: bool = False) -> ExportReport:
    out = Path(out)
    check_format(fmt, quant or "native")
    check_output(out, force)  # before minutes of loading
    if fmt == "gguf":
        from localpd.export.gguf import export_gguf as write
    else:
        from localpd.export.compressed_tensors import compressed_tensors, export_compressed_tensors as write

        compressed_tensors()
    source = load_source(model, fmt, quant)
    report = ExportReport(str(out))
    write_replacing(out, force, lambda tmp: write(source, tmp, report))
    return report


def run_export(args) -> int:
    report = export_model(args.model, args.format, args.out, args.quant, args.force)
    for line in report.lines():
        print(line, file=sys.stderr)
    print(report.path)
    return 0
