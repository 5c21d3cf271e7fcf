"""The redactor: every form of a secret masked, short values left alone, streams cut anywhere; the masked type."""

from __future__ import annotations

import copy
import json
import pickle

import pytest

from kinetic_nb.runner.redact import MASK, MIN_SECRET_CHARS, Redactor, SecretValue, host_secrets

VALUE = "a\\b\"c'd\ne-é-secret"


def shown(value: str) -> list[str]:
    """Texts a secret ends up in: an exception's message, a repr of a repr, a JSON record, an escaped log line."""
    return [
        str(KeyError(value)),
        repr(["x", value]),
        repr(repr(value)),
        f"failed: {value!r} and {value}",
        json.dumps({"token": value}),
        json.dumps({"token": value}, ensure_ascii=False),
        value.encode("unicode_escape").decode(),
        ascii(value),
        repr(f"both quotes \"' around {value}"),
    ]


@pytest.mark.parametrize("text", shown(VALUE), ids=range(len(shown(VALUE))))
def test_every_form_of_a_secret_is_masked(text):
    redacted = Redactor([VALUE]).text(text)
    assert MASK in redacted
    for part in ("a\\b", "e-é-secret", "e-\\xe9-secret", "e-\\u00e9-secret"):
        assert part not in redacted


def test_a_short_value_is_a_setting_not_a_secret():
    short = "x" * (MIN_SECRET_CHARS - 1)
    redactor = Redactor([short, "\\" * (MIN_SECRET_CHARS - 1)])
    assert not redactor
    assert redactor.text(f"{short} {short!r}") == f"{short} {short!r}"


@pytest.mark.parametrize("text", [repr(VALUE), json.dumps(VALUE), repr(repr(VALUE))], ids=["repr", "json", "repr2"])
def test_a_stream_cut_anywhere_never_lets_a_form_through(text):
    """A form longer than the value itself is held back at a chunk's end until the next shows what it was."""
    redactor = Redactor([VALUE])
    line = f"before {text} after"
    for cut in range(len(line) + 1):
        out, held = redactor.split_safe(line[:cut])
        ready, rest = redactor.split_safe(held + line[cut:])
        assert out + ready + redactor.text(rest) == redactor.text(line), cut
        assert MASK in out + ready + rest


def test_host_secrets_reads_the_values_of_the_named_variables():
    redactor = host_secrets("ab" * 32, ["TOKEN", "UNSET"], {"TOKEN": VALUE, "OTHER": "not-a-secret-value"})
    assert redactor.text(f"{VALUE!r} {'ab' * 32} not-a-secret-value") == "'***' *** not-a-secret-value"


def test_a_secret_value_is_its_value_but_never_its_repr():
    secret = SecretValue(VALUE)
    assert secret == VALUE and str(secret) == VALUE and f"{secret}" == VALUE and type(str(secret)) is str
    for text in (repr(secret), repr({"TOKEN": secret}), repr([secret]), f"{secret!r}"):
        assert "secret" not in text.replace("SecretValue", "") and MASK in text
    assert Redactor([secret]).text(repr(VALUE)) == repr(MASK)  # its repr is not what the redactor matches


def test_a_secret_value_pickles_and_copies_as_itself():
    secret = SecretValue(VALUE)
    for again in (pickle.loads(pickle.dumps(secret)), copy.copy(secret), copy.deepcopy({"k": secret})["k"]):
        assert type(again) is SecretValue and again == VALUE and repr(again) == repr(MASK)
