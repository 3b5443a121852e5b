"""Where an export goes: an existing path is refused unless forced, and the result is written under a temporary
name beside it and renamed into place, so an interrupted export leaves nothing under the final name."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from localpd.errors import LocalpdError


def check_output(out: Path, force: bool) -> None:
    if out.exists() and not force:
        raise LocalpdError(f"{out} exists; choose another path or pass --force to replace it")
    if not out.parent.is_dir():
        raise LocalpdError(f"{out.parent} is not a directory")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def write_replacing(out: Path, force: bool, write: Callable[[Path], None]) -> Path:
    """write(tmp) fills a temporary path beside `out` (a file or a directory, as write makes it), which then
    replaces `out`. Whatever stops write (an error, Ctrl+C) removes the temporary path."""
    out = Path(out)
    check_output(out, force)
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    _remove(tmp)
    try:
        write(tmp)
        if out.exists() or out.is_symlink():
            _remove(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            _remove(tmp)
    return out
