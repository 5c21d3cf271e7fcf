"""``RegistryAndCloudBuildDouble``: a double of the HTTP calls the build image mode and the doctor make to Google.

Cloud Build, Artifact Registry and Resource Manager cannot be reached here.
The double stands in for ``google-auth``'s ``AuthorizedSession`` (``get`` and
``post``), answers as those REST APIs document, and records every call, so
tests check what kinetic_nb sends and how it reads the answers, not whether
Google's services accept it (docs/gke.md says so).
"""

from __future__ import annotations

PROJECT_PERMISSIONS = frozenset({"cloudbuild.builds.create", "cloudbuild.builds.get"})


class Answer:
    def __init__(self, status_code: int, body: dict | None = None):
        self.status_code, self._body, self.text = status_code, body or {}, str(body)

    def json(self) -> dict:
        return self._body


def google_error(code: int, message: str, reason: str | None = None) -> Answer:
    """An error as Google's APIs answer one (``google.rpc.Status``, with an ``ErrorInfo`` reason)."""
    details = [{"@type": "type.googleapis.com/google.rpc.ErrorInfo", "reason": reason}] if reason else []
    return Answer(code, {"error": {"code": code, "message": message, "status": "PERMISSION_DENIED" if code == 403
                                   else "NOT_FOUND", "details": details}})


class RegistryAndCloudBuildDouble:
    """Answers as the registry's Docker v2 API, Artifact Registry's, Cloud Build's and Resource Manager's
    REST APIs would; records every call.

    Parameters
    ----------
    images : set of str
        ``HOST/PATH:TAG`` the registry has.
    outcome : str
        How a build ends (its ``status``); ``polls``: how many reads of its operation until it does.
    repositories : dict
        ``projects/P/locations/L/repositories/R`` -> its format (``DOCKER``), as Artifact Registry has them.
    disabled : set of str
        APIs not enabled in the project (``artifactregistry``, ``cloudbuild``): a 403 SERVICE_DISABLED.
    denied : set of str
        APIs this user may not call (a plain 403 PERMISSION_DENIED).
    permissions : set of str
        The project permissions ``testIamPermissions`` says this user holds.
    """

    def __init__(self, *, images: set[str] = frozenset(), outcome: str = "SUCCESS", polls: int = 2,
                 repositories: dict[str, str] | None = None, disabled: set[str] = frozenset(),
                 denied: set[str] = frozenset(), permissions: set[str] = PROJECT_PERMISSIONS):
        self.images, self.outcome, self.polls_left = set(images), outcome, polls
        self.repositories = dict(repositories or {})
        self.disabled, self.denied, self.permissions = set(disabled), set(denied), set(permissions)
        self.calls: list[tuple[str, str, dict]] = []

    def _refusal(self, api: str) -> Answer | None:
        if api in self.disabled:
            return google_error(403, f"{api} API has not been used in project 123 before or it is disabled.",
                                "SERVICE_DISABLED")
        if api in self.denied:
            return google_error(403, "The caller does not have permission", "IAM_PERMISSION_DENIED")
        return None

    def get(self, url: str, headers: dict | None = None) -> Answer:
        self.calls.append(("GET", url, headers or {}))
        if "/v2/" in url:
            host_path, tag = url.split("/manifests/")
            image = host_path.replace("https://", "").replace("/v2/", "/") + ":" + tag
            return Answer(200 if image in self.images else 404)
        if url.startswith("https://artifactregistry.googleapis.com/v1/"):
            path = url.removeprefix("https://artifactregistry.googleapis.com/v1/")
            refusal = self._refusal("artifactregistry")
            if refusal is not None:
                return refusal
            if path not in self.repositories:
                return google_error(404, f"Requested entity was not found: {path}")
            return Answer(200, {"name": path, "format": self.repositories[path]})
        if "/builds?" in url:
            return self._refusal("cloudbuild") or Answer(200, {"builds": []})
        self.polls_left -= 1
        if self.polls_left > 0:
            return Answer(200, {"name": "operations/build-1", "done": False})
        return Answer(200, {"name": "operations/build-1", "done": True,
                            "response": {"status": self.outcome, "logUrl": "https://console/logs/1",
                                         "statusDetail": "step 0 exited 1" if self.outcome != "SUCCESS" else ""}})

    def post(self, url: str, json: dict) -> Answer:
        self.calls.append(("POST", url, json))
        if url.endswith(":testIamPermissions"):
            return Answer(200, {"permissions": sorted(set(json["permissions"]) & self.permissions)})
        return Answer(200, {"name": "operations/build-1", "done": False})
