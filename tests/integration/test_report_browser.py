"""report.html in a real browser (Debian's headless Chromium): it loads with no console
error and no request at all besides the page itself, and renders a full 1280 px wide page
with content. The detector is shown to catch a broken image, a console.error and an
external request, so this check can fail."""

from __future__ import annotations

import io
import shutil
import subprocess
from pathlib import Path

import pytest

from attnprof.exporters.report_html import render_html
from tests.report_sample import CHROMIUM, WIDTH, load_page, sample_report

pytestmark = pytest.mark.chromium


@pytest.fixture(scope="module")
def chromium() -> str:
    path = shutil.which(CHROMIUM)
    if path is None:
        pytest.fail("chromium is not installed: `make test` installs it "
                    "(apt-get install chromium)")
    return path


def _png_size_and_colours(png: bytes) -> tuple[tuple[int, int], int]:
    from PIL import Image

    with Image.open(io.BytesIO(png)) as im:
        rgb = im.convert("RGB")
        small = rgb.resize((rgb.width // 4, rgb.height // 4))
        return rgb.size, len(set(small.getdata()))


def test_report_loads_clean_and_renders(chromium: str, tmp_path: Path) -> None:
    page = tmp_path / "report.html"
    page.write_text(render_html(sample_report()), encoding="utf-8")
    res = load_page(page)
    assert res.console_errors == []
    assert res.failed_requests == []
    assert res.requests == []  # nothing but the page itself: no font, image, script, link
    assert res.png is not None
    (w, h), colours = _png_size_and_colours(res.png)
    assert w == WIDTH and h == res.height and h > 3000
    assert colours > 50  # text, plots and badges, not a blank page

    # The plain command line the brief names works too, with a window tall enough.
    png = tmp_path / "cli.png"
    proc = subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
         f"--window-size={WIDTH},{res.height}", "--enable-logging=stderr", "--v=0",
         f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={png}", page.as_uri()],
        capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (w2, h2), colours2 = _png_size_and_colours(png.read_bytes())
    assert (w2, h2) == (WIDTH, res.height) and colours2 > 50


def test_detector_catches_errors_and_requests(chromium: str, tmp_path: Path) -> None:
    page = tmp_path / "broken.html"
    page.write_text("<!DOCTYPE html><html><body><h1>broken</h1>"
                    '<img src="missing.png" alt="">'
                    '<img src="https://attnprof.invalid/x.png" alt="">'
                    "<script>console.error('boom-from-test')</script>"
                    "<script>undefined_function_here()</script></body></html>",
                    encoding="utf-8")
    res = load_page(page, screenshot=False)
    errors = "\n".join(res.console_errors)
    assert "console.error: boom-from-test" in errors
    assert "undefined_function_here" in errors  # an uncaught exception
    assert "Failed to load resource" in errors
    assert any(r.startswith((tmp_path / "missing.png").as_uri() + ": ")
               and "ERR_FILE_NOT_FOUND" in r for r in res.failed_requests), res.failed_requests
    assert any("attnprof.invalid" in r for r in res.failed_requests), res.failed_requests
    assert sorted(res.requests) == sorted([(tmp_path / "missing.png").as_uri(),
                                           "https://attnprof.invalid/x.png"])


def test_the_advice_basis_section_renders_clean(chromium: str, tmp_path: Path) -> None:
    """The section on what the window advice stands on (coverage per context bucket, the
    need-more-traffic verdict, dynamic heads), in a report from a snapshot that has it."""
    from attnprof.contracts.report import Report, ReportSource
    from tests.unit.analyze.test_advice_basis import _model

    rep = Report(generated_at=0.0, source=ReportSource(kind="files", where=["demo.json"]),
                 models=[_model()], formulas={}, versions={})
    page = tmp_path / "report.html"
    page.write_text(render_html(rep), encoding="utf-8")
    res = load_page(page)
    assert res.console_errors == [] and res.failed_requests == [] and res.requests == []
    assert res.png is not None
    (w, h), colours = _png_size_and_colours(res.png)
    assert w == WIDTH and h == res.height and colours > 20
