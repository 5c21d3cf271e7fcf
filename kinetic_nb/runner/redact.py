"""Secrets out of a host's logs and reports: the job's key and every ``-e`` value become ``***``.

A value shorter than :data:`MIN_SECRET_CHARS` is not treated as a secret
(``-e DEBUG=1`` must not blank every "1" of a log). Streamed text is redacted
whatever its chunk boundaries: the tail that could be the start of a secret
waits for the next chunk.

A value is matched in every form text gives it, not only as itself: an
exception's message shows ``repr(value)`` (``KeyError(value)``), a JSON record
its escaped form, and a repr of a repr doubles each backslash. A value with a
``\\``, a quote, a newline or a non-ASCII character looks different in each.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping

#: Shorter values are settings, not secrets; redacting them would garble the log.
MIN_SECRET_CHARS = 6
MASK = "***"
#: Appended to a value to make ``repr`` quote it with ``'`` and escape every ``'``
#: in it: that is how it looks inside a longer string's repr that holds both quotes.
_BOTH_QUOTES = "\"'"


class SecretValue(str):
    """A secret string (a ``-e`` value): itself wherever a string is used, masked in every repr.

    Tracebacks (``%xmode Verbose`` prints each frame's locals), containers and
    ``%r`` show a repr, so a secret held in a ``SecretValue`` is never printed
    by accident. ``str(value)`` is the plain value: that is how it is handed on.

    It pickles as itself, so the mask survives the out-of-band hops a secret
    is meant to take (a Ray actor's arguments); storage never receives one
    because no stored record holds a secret (the plan keeps only names).
    """

    __slots__ = ()

    def __repr__(self) -> str:
        return repr(MASK)

    def __reduce__(self) -> tuple:
        return SecretValue, (str(self),)


def _escaped(text: str) -> set[str]:
    """``text`` as one level of escaping shows it: repr and JSON bodies, ASCII escapes, doubled backslashes."""
    both_quoted = repr(text + _BOTH_QUOTES)[1:-1]
    return {
        repr(text)[1:-1],
        both_quoted[: len(both_quoted) - len(repr(_BOTH_QUOTES)[1:-1])],
        ascii(text)[1:-1],
        json.dumps(text)[1:-1],
        json.dumps(text, ensure_ascii=False)[1:-1],
        text.encode("unicode_escape").decode("ascii"),
        text.replace("\\", "\\\\"),
    }


def secret_forms(value: str) -> set[str]:
    """Every form ``value`` takes in text: itself, and it escaped once and twice (a repr of a repr, JSON of a repr).

    Parameters
    ----------
    value : str
        The secret (a :class:`SecretValue` is read as its plain value).

    Returns
    -------
    set of str
        The distinct forms, ``value`` among them.
    """
    plain = str(value)  # a SecretValue's repr is the mask, not its value
    once = {plain} | _escaped(plain)
    return once | {twice for form in once for twice in _escaped(form)}


class Redactor:
    """Replaces each of ``secrets``, in each of its :func:`secret_forms`, with :data:`MASK`."""

    def __init__(self, secrets: Iterable[str]):
        values = {str(s) for s in secrets if len(s) >= MIN_SECRET_CHARS}
        #: Every form of every secret, longest first (the longest match wins).
        self.secrets = sorted({form for value in values for form in secret_forms(value)}, key=len, reverse=True)
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
