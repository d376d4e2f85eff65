"""The embedded default's Celery broker: kombu's filesystem transport, with its files written whole.

kombu's filesystem transport creates a message file in the queue folder and then writes it, and creates
an exchange's table file and then writes it. A reader that looks in between reads an empty file, and
``json.loads('')`` ends the Celery worker ("Unrecoverable error: JSONDecodeError"): ``manage.py serve``
restarts it, but the watchdog misses its passes meanwhile (seen as "the watchdog did not run for 5.3 s" in
the default-cadence test). Here a message is written aside (a folder beside the queue's, on the same file
system) and renamed into the queue folder whole, and a new exchange table read empty is read again once
its writer has written it. A message file that still cannot be read (written by something else) is logged
and dropped, not allowed to end the worker.

Settings: ``CELERY_BROKER_TRANSPORT = "controlplane.filesystem_broker:Transport"`` with ``filesystem://``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
import uuid
from typing import Any

from kombu.exceptions import ChannelError
from kombu.transport import filesystem
from kombu.utils.encoding import str_to_bytes
from kombu.utils.json import dumps

log = logging.getLogger(__name__)

#: A new exchange table read empty is read again this many times, this far apart (its writer holds the
#: file's lock for one small write).
TABLE_TRIES, TABLE_RETRY_S = 50, 0.02


def _write_aside(folder: str, name: str, data: bytes) -> str:
    """``data`` in a new file of ``folder`` that no reader takes (a dot name ending in ``.part``)."""
    tmp = os.path.join(folder, f".{name}.{uuid.uuid4().hex[:8]}.part")
    with open(tmp, "wb") as f:
        f.write(data)
    return tmp


class Channel(filesystem.Channel):
    @functools.cached_property
    def _aside(self) -> str:
        """Where messages are written before they are renamed into the queue folder: beside it, on the same
        file system (made once per channel, not per message)."""
        folder = os.path.join(os.path.dirname(os.path.abspath(self.data_folder_out)), ".partial")
        os.makedirs(folder, exist_ok=True)
        return folder

    def _put(self, queue: str, payload: Any, **kwargs: Any) -> None:
        name = f"{round(time.monotonic() * 1000)}_{uuid.uuid4()}.{queue}.msg"  # kombu's name and order
        tmp = ""
        try:
            tmp = _write_aside(self._aside, name, str_to_bytes(dumps(payload)))
            os.replace(tmp, os.path.join(self.data_folder_out, name))
        except OSError as exc:
            if tmp:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
            raise ChannelError(f"Cannot add file {name!r} to directory") from exc

    def _get(self, queue: str) -> Any:
        while True:  # each try takes one file off the queue: this ends with a message or Empty
            try:
                return super()._get(queue)
            except ValueError as exc:  # not JSON: nothing can deliver it
                log.error("broker: dropped an unreadable message of queue %s: %s", queue, exc)

    def get_table(self, exchange: str) -> Any:
        """An exchange's table, read again while it is a new file not written yet (kombu creates the file,
        then locks and writes it: a reader can take its shared lock in between and read nothing)."""
        for _ in range(TABLE_TRIES - 1):
            try:
                return super().get_table(exchange)
            except ValueError:
                time.sleep(TABLE_RETRY_S)
        return super().get_table(exchange)


class Transport(filesystem.Transport):
    Channel = Channel
