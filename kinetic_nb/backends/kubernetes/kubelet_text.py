"""Text for the kubelet: ``env`` entries and commands it leaves exactly as written, or expands on purpose.

The kubelet expands ``$(VAR)`` in a container's env values, command and args,
and turns ``$$`` into ``$``: what must arrive as written is escaped here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

__all__ = ["escape", "field_reference", "literal", "literal_command", "literal_env", "reference"]

#: A ``$`` the kubelet would read as the start of ``$$`` or ``$(VAR)``.
_KUBELET_SPECIAL = re.compile(r"\$(?=[$(])")


def escape(text: str) -> str:
    """``text`` as a literal for the kubelet, which expands ``$(VAR)`` in env values, command
    and args and turns ``$$`` into ``$``: a ``$`` before ``$`` or ``(`` is doubled, any other
    ``$`` is kept as it is (so a shell script stays readable)."""
    return _KUBELET_SPECIAL.sub("$$", text)


def literal(name: str, value: str) -> dict[str, str]:
    """A literal variable."""
    return {"name": name, "value": escape(value)}


def literal_env(variables: Mapping[str, str]) -> list[dict[str, str]]:
    """``variables`` as a container's ``env`` entries that the kubelet leaves exactly as written."""
    return [literal(name, value) for name, value in variables.items()]


def literal_command(*words: str) -> list[str]:
    """``words`` as a container's ``command`` or ``args`` that the kubelet leaves exactly as written."""
    return [escape(word) for word in words]


def reference(name: str, value: str) -> dict[str, str]:
    """A variable built from earlier ones with the kubelet's ``$(VAR)`` expansion."""
    return {"name": name, "value": value}


def field_reference(name: str, field_path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": field_path}}}
