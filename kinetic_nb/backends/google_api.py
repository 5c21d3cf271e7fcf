"""A session for Google's REST APIs with the notebook's own credentials, or one line saying what is missing."""

from __future__ import annotations

from typing import Any

from kinetic_nb.errors import KineticError

__all__ = ["authorized_session"]

#: What every call here asks of the credentials.
CLOUD_PLATFORM = "https://www.googleapis.com/auth/cloud-platform"


def authorized_session(needs: str) -> tuple[Any, str | None]:
    """google-auth's ``AuthorizedSession`` with the notebook's Application Default Credentials, and their project
    (None when they name none); ``KineticError`` in one line beginning with ``needs`` (what wants them: "the
    build image mode") when google-auth is missing or no credentials are found."""
    try:
        import google.auth
        import google.auth.exceptions
        from google.auth.transport.requests import AuthorizedSession
    except ImportError as error:
        raise KineticError(f"{needs} calls Google's APIs through google-auth: pip install 'kinetic_nb[gcs]'") from error
    try:
        credentials, project = google.auth.default(scopes=[CLOUD_PLATFORM])
    except google.auth.exceptions.DefaultCredentialsError as error:
        raise KineticError(f"{needs} needs Google credentials: run `gcloud auth application-default login`") from error
    return AuthorizedSession(credentials), project
