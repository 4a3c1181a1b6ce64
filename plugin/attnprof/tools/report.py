"""Assemble ``attnprof report``: gather a source, check flags against the installed vLLM,
build each model's what-ifs and money, and render report.json / .md / .html together.

Writing is all-or-nothing: the three files are rendered in memory first, then each is
written through a temp file and renamed, so a failure never leaves half a report.
"""

from __future__ import annotations

import time
from pathlib import Path

from attnprof.analyze.cost import FORMULAS, Settings, build_model_report
from attnprof.contracts.report import Report
from attnprof.tools.report_sources import Gathered, flag_checks

__all__ = ["FILES", "build_report", "render_all", "write_all"]

FILES = ("report.html", "report.md", "report.json")


def _versions(g: Gathered) -> dict[str, str | None]:
    from attnprof import __version__
    from attnprof.tools.provenance import package_version
    from attnprof.tools.vllm_flags import vllm_version

    out: dict[str, str | None] = {"attnprof": __version__, "vllm": vllm_version(),
                                  "torch": package_version("torch"),
                                  "transformers": package_version("transformers")}
    if g.provenance is not None:
        out.update({"server_attnprof": g.provenance.attnprof, "server_vllm": g.provenance.vllm,
                    "server_torch": g.provenance.torch})
    return out


def build_report(g: Gathered, settings: Settings, t0: float | None = None) -> Report:
    """The report document for every model the source holds."""
    from attnprof.exporters.money import saving_lines

    models = []
    for inp in g.inputs:
        flags = flag_checks(inp.backends, inp.architecture)
        m = build_model_report(inp, settings, flags)
        m.savings = saving_lines(m)  # the text, rendered from the ranked what-ifs
        models.append(m)
    start = time.monotonic() if t0 is None else t0
    rep = Report(generated_at=time.time(), source=g.source, models=models,
                 formulas=dict(FORMULAS), versions=_versions(g), provenance=g.provenance)
    rep.report_seconds = time.monotonic() - start
    return rep


def render_all(rep: Report) -> dict[str, str]:
    """File name -> text of the three renderings (nothing written)."""
    import json

    from attnprof.exporters.report_html import render_html
    from attnprof.exporters.report_md import render_markdown

    return {"report.html": render_html(rep), "report.md": render_markdown(rep),
            "report.json": json.dumps(rep.to_json(), indent=2) + "\n"}


def write_all(out_dir: Path, texts: dict[str, str]) -> list[Path]:
    """Write every rendering: all temp files first, then the renames, so a failure (a full
    disk) leaves the previous report whole and no temp file behind. :class:`OSError` for
    the caller to report in one line."""
    import os
    import secrets

    out_dir.mkdir(parents=True, exist_ok=True)
    temps: list[tuple[Path, Path]] = []
    try:
        for name, text in texts.items():
            tmp = out_dir / f".{name}.{secrets.token_hex(8)}.tmp"
            temps.append((tmp, out_dir / name))
            with open(tmp, "x", encoding="utf-8") as f:
                f.write(text)
        for tmp, path in temps:
            os.replace(tmp, path)
    finally:
        for tmp, _ in temps:
            tmp.unlink(missing_ok=True)
    return [path for _, path in temps]
