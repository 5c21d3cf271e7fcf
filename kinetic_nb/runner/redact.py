"""Secrets out of a host's logs and reports: the job's key and every ``-e`` value become ``***``.

A value shorter than :data:`MIN_SECRET_CHARS` is not treated as a secret
(``-e DEBUG=1`` must not blank every "1" of a log). Streamed text is redacted
whatever its chunk boundaries: the tail that could be the start of a secret
waits for the next chunk.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping

#: Shorter values are settings, not secrets; redacting them would garble the log.
MIN_SECRET_CHARS = 6
MASK = "***"


class Redactor:
    """Replaces each of ``secrets`` with :data:`MASK`."""

    def __init__(self, secrets: Iterable[str]):
        self.secrets = sorted({s for s in secrets if len(s) >= MIN_SECRET_CHARS}, key=len, reverse=True)
        self._pattern = re.compile("|".join(map(re.escape, self.secrets))) if self.secrets else None

    def __bool__(self) -> bool:
        return self._pattern is not None

    def text(self, text: str) -> str:
        """``text`` with every secret masked."""
        return self._pattern.sub(MASK, text) if self._pattern else text

    def split_safe(self, text: str) -> tuple[str, str]:
        """``(ready, held)``: ``ready`` redacted, ``held`` the tail that may be a secret's beginning."""
        if not self._pattern:
            return text, ""
        redacted = self.text(text)
        for cut in range(max(0, len(redacted) - len(self.secrets[0]) + 1), len(redacted)):
            tail = redacted[cut:]
            if any(secret.startswith(tail) for secret in self.secrets):
                return redacted[:cut], tail
        return redacted, ""


def host_secrets(key_hex: str | None, env_names: Iterable[str], environ: Mapping[str, str] = os.environ) -> Redactor:
    """The redactor for a host of a job: its key, and the values of the ``-e`` variables in ``environ``."""
    values = [environ[name] for name in env_names if environ.get(name)]
    return Redactor([*values, *([key_hex] if key_hex else [])])
