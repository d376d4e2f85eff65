"""The embedded default's broker (controlplane.filesystem_broker): readers only ever see whole files.

kombu's own filesystem transport creates a message file (and a new exchange's table) before writing it;
a worker that read one in between died on ``json.loads('')`` and the watchdog missed its passes. Here a
producer, a consumer and an observer share the folders, as beat, the web server and the worker do: the
observer reads every message file it can see while they are written. With kombu's own transport
(``UNBROKEN_TEST_BROKER_TRANSPORT=filesystem``) the first test fails in most runs (2 of 3 here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

from kombu import Connection

ROOT = Path(__file__).resolve().parents[3]
TRANSPORT = os.environ.get("UNBROKEN_TEST_BROKER_TRANSPORT", "controlplane.filesystem_broker:Transport")
QUEUES, PER_QUEUE, BODY = 12, 8, "x" * (1 << 20)


def connection(root: Path) -> Connection:
    return Connection("filesystem://", transport=TRANSPORT, transport_options={
        "data_folder_in": str(root / "in"), "data_folder_out": str(root / "in"),
        "data_folder_processed": str(root / "processed"), "store_processed": False,
        "control_folder": str(root / "control"), "polling_interval": 0.0})


def test_readers_see_only_whole_messages_and_exchange_tables(tmp_path):
    for sub in ("in", "processed", "control"):
        (tmp_path / sub).mkdir()
    partial: list[str] = []
    received: list[tuple[str, int]] = []
    errors: list[str] = []
    done = threading.Event()

    def observe() -> None:
        while not done.is_set():
            for name in os.listdir(tmp_path / "in"):
                if not name.endswith(".msg"):
                    continue
                try:
                    json.loads((tmp_path / "in" / name).read_bytes())
                except FileNotFoundError:
                    pass  # taken meanwhile
                except ValueError:
                    partial.append(name)

    def produce() -> None:
        with connection(tmp_path) as c:
            for q in range(QUEUES):  # each queue its own exchange: a new table file each time
                with c.SimpleQueue(f"q{q}") as queue:
                    for i in range(PER_QUEUE):
                        queue.put({"i": i, "body": BODY})

    def consume() -> None:
        with connection(tmp_path) as c:
            for q in range(QUEUES):
                with c.SimpleQueue(f"q{q}") as queue:
                    for _ in range(PER_QUEUE):
                        try:
                            m = queue.get(timeout=10)
                        except queue.Empty:
                            # kombu's own transport also loses a message now and then in this crossfire
                            # (1 in ~5 runs of 96, with or without this module's writes): not this test's
                            # subject, which is that nothing half-written is read.
                            break
                        except Exception as e:  # noqa: BLE001 - what the worker would have died of
                            errors.append(repr(e)[:200])
                            return
                        received.append((f"q{q}", m.payload["i"]))
                        m.ack()

    threads = [threading.Thread(target=f) for f in (observe, produce, consume)]
    for t in threads:
        t.start()
    for t in threads[1:]:
        t.join(120)
    done.set()
    threads[0].join(10)
    assert errors == []  # the producer read every new exchange table, the consumer every message
    assert partial == []  # no message file was ever visible before it was whole
    assert len(received) >= QUEUES * PER_QUEUE - 3, len(received)


def test_an_unreadable_message_is_dropped_and_the_next_one_delivered(tmp_path, caplog):
    for sub in ("in", "processed", "control"):
        (tmp_path / sub).mkdir()
    with connection(tmp_path) as c, c.SimpleQueue("q") as queue:
        queue.put({"i": 1})
        (tmp_path / "in" / "0_bad.q.msg").write_bytes(b"")  # sorts first: an empty file, as a crash leaves
        m = queue.get(timeout=5)
        assert m.payload == {"i": 1}
        m.ack()
    assert "dropped an unreadable message of queue q" in caplog.text


def test_the_embedded_default_uses_it(tmp_path):
    """Without REDIS_URL (the default setup), Celery's broker is this transport."""
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    env.update(UNBROKEN_DATA_DIR=str(tmp_path), UNBROKEN_SECRET_KEY="k" * 50, PYTHONPATH=str(ROOT),
               DJANGO_SETTINGS_MODULE="controlplane.settings")
    out = subprocess.run([sys.executable, "-c", "from controlplane.celery import app; "
                          "print(app.connection_for_write().transport_cls)"],
                         env=env, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "controlplane.filesystem_broker:Transport"
