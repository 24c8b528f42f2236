"""Log lines for machines: `--log-format json` writes one JSON object per record.

Fields: time (ISO 8601, UTC), level, logger, message (formatted), and the exception
text when there is one; a worker process adds its rank. The human format stays the default.
"""

from __future__ import annotations

import datetime
import json
import logging


class JsonFormatter(logging.Formatter):
    def __init__(self, fields: dict | None = None) -> None:
        """`fields`: set on every line (a worker process's rank)."""
        super().__init__()
        self.fields = dict(fields or {})

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            **self.fields,
            "time": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def configure_logging(level: str, fmt: str = "text", prefix: str = "", fields: dict | None = None) -> None:
    """The root logger at `level` ("info", "debug", ...), lines as text or JSON.

    `prefix` goes before the logger's name in text lines and `fields` into every JSON
    line: a worker process passes its rank as both.
    """
    logging.basicConfig(level=level.upper(), format=f"%(asctime)s %(levelname)s {prefix}%(name)s: %(message)s", datefmt="%H:%M:%S",
                        force=True)
    if fmt == "json":
        for handler in logging.getLogger().handlers:
            handler.setFormatter(JsonFormatter(fields))
