"""Long-running commands stop on Ctrl-C / SIGTERM by a flag their loop reads (never by an
exception raised from the handler, which Python drops when it lands in a weakref or
``__del__`` callback: a lost stop, seen in CI)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from attnprof.cli._common import StopSignals
from tests.bearer_server import BearerJsonServer
from tests.unit.exporters.test_tensorboard import _snapshot_doc


@pytest.fixture
def snap_server() -> Iterator[BearerJsonServer]:
    srv = BearerJsonServer("k3y", _snapshot_doc)
    yield srv
    srv.stop()


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_real_signal_ends_the_nap_and_the_old_handler_comes_back(sig: int) -> None:
    before = signal.getsignal(sig)
    with StopSignals() as stop:
        assert signal.getsignal(sig) != before
        assert not stop.requested and not stop.nap(0.01)
        threading.Timer(0.2, os.kill, (os.getpid(), sig)).start()
        t0 = time.monotonic()
        assert stop.nap(60)  # a flag, not an exception: the nap returns True
        assert time.monotonic() - t0 < 60  # ended by the signal, not by its length
        assert stop.received == [sig]
    assert signal.getsignal(sig) == before


def test_a_handler_run_inside_a_weakref_callback_is_not_lost() -> None:
    import weakref

    class Dropped:
        pass

    with StopSignals() as stop:
        handler = signal.getsignal(signal.SIGTERM)
        assert callable(handler)
        obj = Dropped()
        ref = weakref.ref(obj, lambda _r: handler(signal.SIGTERM, None))
        del obj
        assert ref() is None and stop.requested


@pytest.mark.slow
def test_record_stopped_by_sigterm_still_writes_the_shorter_window(
        snap_server: BearerJsonServer, tmp_path: Path) -> None:
    out = tmp_path / "rec.json"
    proc = subprocess.Popen([sys.executable, "-m", "attnprof.cli", "record", "--url",
                             snap_server.url, "--duration", "10m", "--out", str(out)],
                            env={**os.environ, "ATTNPROF_API_KEY": "k3y"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    first = proc.stderr.readline()  # the first progress line: the start snapshot is taken
    assert first.startswith("attnprof record:"), first
    proc.send_signal(signal.SIGTERM)
    stdout, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "Traceback" not in err and f"wrote {out}" in stdout
    doc = json.loads(out.read_text())
    assert doc["window"]["note"].startswith("stopped early by SIGTERM; ")
    assert len(snap_server.served) == 2  # start and end, nothing else
