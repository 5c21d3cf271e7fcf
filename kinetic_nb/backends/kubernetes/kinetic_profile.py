"""A cluster that keras-kinetic's ``kinetic up`` made: where it is, as kinetic records it, so ``-b kubernetes``
needs no setting of its own there.

``kinetic up`` provisions a GKE cluster (the LeaderWorkerSet CRD, node pools per accelerator, a ``kinetic``
Kubernetes service account bound to a Google one by Workload Identity, and a jobs bucket) and saves the target
as the active profile in ``~/.kinetic/profiles.json`` (``$KINETIC_PROFILES_FILE``)::

    {"current": "dev-tpu", "profiles": {"dev-tpu": {"project": "p", "zone": "us-central2-b",
                                                    "cluster": "kinetic-cluster", "namespace": "default"}}}

Its own variables (``KINETIC_PROJECT``, ``KINETIC_ZONE``, ``KINETIC_CLUSTER``, ``KINETIC_NAMESPACE``) rank above
the profile, as in kinetic. The format, the bucket's name (``{project}-kn-{cluster}-jobs``) and the service
account's (``kinetic``) follow keras-kinetic 0.0.4 (``kinetic/cli/profiles.py``, ``kinetic/constants.py``,
``kinetic/cli/constants.py``), read here without importing it (it brings Pulumi and the Google Cloud SDKs).
Standard library only.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path

__all__ = ["KINETIC_SERVICE_ACCOUNT", "PROFILES_ENV", "KineticTarget", "kinetic_target"]

PROFILES_ENV = "KINETIC_PROFILES_FILE"
DEFAULT_PROFILES_FILE = "~/.kinetic/profiles.json"
#: The Kubernetes service account ``kinetic up`` makes, bound to its node service account by Workload Identity.
KINETIC_SERVICE_ACCOUNT = "kinetic"
#: The prefix this package's jobs take in kinetic's jobs bucket.
BUCKET_PREFIX = "kinetic_nb"


@dataclasses.dataclass(frozen=True)
class KineticTarget:
    """The cluster a keras-kinetic profile (or its variables) names."""

    project: str
    zone: str
    cluster: str
    namespace: str = "default"
    #: The profile it came from; None where kinetic's variables alone name it.
    profile: str | None = None

    @property
    def context(self) -> str:
        """The kubeconfig context ``gcloud container clusters get-credentials`` writes for the cluster."""
        return f"gke_{self.project}_{self.zone}_{self.cluster}"

    @property
    def storage(self) -> str:
        """This package's jobs in the bucket ``kinetic up`` made for the cluster's jobs."""
        return f"gs://{self.project}-kn-{self.cluster}-jobs/{BUCKET_PREFIX}"

    @property
    def get_credentials(self) -> str:
        return f"gcloud container clusters get-credentials {self.cluster} --zone {self.zone} --project {self.project}"

    def describe(self) -> str:
        where = f"keras-kinetic profile {self.profile}" if self.profile else "keras-kinetic's KINETIC_* variables"
        return f"{where}: cluster {self.cluster} in {self.zone}, project {self.project}, namespace {self.namespace}"


def kinetic_target(environ: Mapping[str, str] | None = None) -> KineticTarget | None:
    """The cluster keras-kinetic would use: its variables over its active profile; None when there is neither
    an active profile nor ``KINETIC_PROJECT`` with ``KINETIC_CLUSTER`` (a malformed profiles file counts as none)."""
    environ = os.environ if environ is None else environ
    profile_name, fields = _active_profile(Path(environ.get(PROFILES_ENV) or DEFAULT_PROFILES_FILE).expanduser())
    values = {name: environ.get(f"KINETIC_{name.upper()}", "").strip() or fields.get(name, "")
              for name in ("project", "zone", "cluster", "namespace")}
    if not (values["project"] and values["cluster"] and values["zone"]):
        return None
    return KineticTarget(values["project"], values["zone"], values["cluster"], values["namespace"] or "default",
                         profile_name)


def _active_profile(path: Path) -> tuple[str | None, dict[str, str]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        name = data.get("current")
        fields = data.get("profiles", {}).get(name) if isinstance(name, str) else None
    except (OSError, ValueError, AttributeError):
        return None, {}
    if not isinstance(fields, dict):
        return None, {}
    return name, {key: str(value) for key, value in fields.items() if isinstance(value, str)}
