"""Snapshots of the main screen, the panel and the model picker (pytest-textual-snapshot). Machine-dependent
inputs (the CPU's name, measured bandwidth, what is downloaded) are fixed here so the frames are the same on
every machine; the live numbers themselves are tested against the engine in test_tui.py."""

from textual.widgets import Input

from localpd.measure.device import DeviceInfo
from localpd.tui.app import LocalpdApp
from localpd.tui.panel import BandwidthPanel, PanelData

SIZE = (120, 34)


def no_engine(name):
    raise OSError("no model in snapshot tests")  # the app shows its no-model state


def app(tmp_path):
    return LocalpdApp(no_engine, tmp_path / "c.db")


def test_main_screen(snap_compare, tmp_path):
    assert snap_compare(app(tmp_path), terminal_size=SIZE, run_before=settle)


async def settle(pilot):
    for field in pilot.app.query(Input):
        field.cursor_blink = False  # a blinking cursor is drawn or not by timing: a frame would differ under load
    await pilot.pause(0.3)
    pilot.app.clear_notifications()
    await pilot.pause(0.1)


def test_panel_with_a_finished_reply(snap_compare, tmp_path):
    async def fill(pilot):
        await settle(pilot)
        panel = pilot.app.query_one(BandwidthPanel)
        panel.info = DeviceInfo("NVIDIA GeForce RTX 4090", "cuda", 1008e9, "table", 920e9, "cache", 330e12, "table")
        panel.data = PanelData(token_gbs=[610.0, 700.5, 815.2, 820.0, 790.4], last_gbs=790.4, pct_peak=0.784,
                               pct_measured=0.859, decode_tps=152.3, ceiling_tps=183.0, ttft=0.042,
                               prefill_mfu=0.41, cached_tokens=32, prompt_tokens=37,
                               prefill_point=(120.0, 1.3e14), decode_point=(1.1, 8.7e11))
        panel.show()
        await pilot.pause(0.1)

    assert snap_compare(app(tmp_path), terminal_size=SIZE, run_before=fill)


def test_model_picker(snap_compare, tmp_path, monkeypatch):
    from localpd.load import registry

    entries = [(e, None, None) for e in registry.load_registry()[1].values()]
    monkeypatch.setattr(registry, "list_models", lambda: entries)

    async def open_picker(pilot):
        await settle(pilot)
        await pilot.press("ctrl+l")
        await pilot.pause(0.2)

    assert snap_compare(app(tmp_path), terminal_size=SIZE, run_before=open_picker)
