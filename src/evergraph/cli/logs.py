"""Log output for the CLI: readable text on a terminal, or one JSON object per line."""

from __future__ import annotations

import json
import logging
import sys
import time


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        t = time.strftime("%H:%M:%S", time.localtime(record.created))
        ms = int(record.msecs)
        level = "" if record.levelno == logging.INFO else f"{record.levelname.lower()}: "
        return f"{t}.{ms:03d} {level}{record.getMessage()}"


def setup_logging(fmt: str, verbose: int) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if verbose > 1 else logging.INFO)
    if verbose == 0:
        # Per-resource chatter ("applied") stays at INFO; at -v nothing changes,
        # at -vv debug appears.
        logging.getLogger("asyncio").setLevel(logging.WARNING)
