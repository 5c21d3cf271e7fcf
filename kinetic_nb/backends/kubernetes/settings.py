"""Where and how a kinetic job's pods run: the kubernetes backend's settings, resolved per field.

An explicit argument (a magic flag) > a ``KINETIC_*`` environment variable >
a config object (``%config KineticMagics...``) > the default. No
``kubernetes`` import: the manifests and the magic use these offline.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from typing import Any, ClassVar

from kinetic_nb.backends.kubernetes.image_modes import ImageMode, stock_image
from kinetic_nb.backends.kubernetes.kinetic_profile import KINETIC_SERVICE_ACCOUNT, kinetic_target

__all__ = ["DEFAULT_COORDINATOR_PORT", "DEFAULT_NAMESPACE", "KubernetesSettings"]

DEFAULT_NAMESPACE = "default"
#: The port the JAX coordinator (or torch's rendezvous) listens on, on host 0:
#: torch.distributed's customary one (torchrun's default ``MASTER_PORT``). Not
#: JAX's own 8476, nor anything in 8470-8482: those are libtpu's on a TPU host,
#: and a coordinator there collides with the TPU runtime.
DEFAULT_COORDINATOR_PORT = 29500

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")

#: A pod Pending longer than this fails its host with the reason it waited. Long
#: enough for GKE to scale a multi-host TPU node pool up from zero (a whole slice
#: at once, often ten minutes, more when capacity is tight) and then pull a
#: multi-gigabyte JAX image. A wait that can never end (a wrong image, no
#: matching node pool, a quota) fails at once instead: see ``k8s_events``.
DEFAULT_PENDING_TIMEOUT_S = 45 * 60.0


@dataclasses.dataclass(frozen=True)
class KubernetesSettings:
    """Where and how a job's pods run.

    Attributes
    ----------
    namespace : str
        Kubernetes namespace of the job's objects (``KINETIC_NAMESPACE``).
    image : str or None
        Container image (``KINETIC_IMAGE``): with kinetic_nb and your packages
        installed (the ``custom`` mode), or the base the pods install into (the
        ``prebuilt`` mode; default :func:`~kinetic_nb.backends.kubernetes.image_modes.stock_image`).
    image_mode : str or None
        ``prebuilt``, ``build`` or ``custom`` (``KINETIC_IMAGE_MODE``; see
        :mod:`kinetic_nb.backends.kubernetes.image_modes`); None: ``custom`` when an
        image is given, else ``prebuilt``.
    requirements : str or None
        A pip requirements file the pods install (``KINETIC_REQUIREMENTS``):
        at their start (``prebuilt``), or into the image Cloud Build makes (``build``).
    registry : str or None
        Where the ``build`` mode's images go, e.g.
        ``us-docker.pkg.dev/PROJECT/kinetic`` (``KINETIC_REGISTRY``).
    service_account : str or None
        The pods' Kubernetes service account, bound to a Google service account
        that may write the bucket via Workload Identity (``KINETIC_SERVICE_ACCOUNT``).
    context : str or None
        kubeconfig context to use instead of the current one (``KINETIC_KUBE_CONTEXT``).
    coordinator_port : int
        Port of the coordinator on host 0 (``KINETIC_COORDINATOR_PORT``); a
        session's direct channel listens on the next one (:attr:`channel_port`).
    pending_timeout_s : float
        The pending limit: a pod still Pending after this long (waiting for
        nodes to be added, pulling its image) fails the job with the reason it
        waited (``KINETIC_PENDING_TIMEOUT``, ``--pending-timeout``; 45 minutes).
        A wait that can never end fails at once. The start barrier waits this
        much longer too.
    node_selector : mapping of str to str
        Node labels added to the accelerator's, e.g. a node pool name
        (``KINETIC_NODE_SELECTOR="cloud.google.com/gke-nodepool=tpu-pool"``,
        comma-separated ``key=value`` pairs).
    """

    namespace: str = DEFAULT_NAMESPACE
    image: str | None = None
    image_mode: str | None = None
    requirements: str | None = None
    registry: str | None = None
    service_account: str | None = None
    context: str | None = None
    coordinator_port: int = DEFAULT_COORDINATOR_PORT
    pending_timeout_s: float = DEFAULT_PENDING_TIMEOUT_S
    node_selector: Mapping[str, str] = dataclasses.field(default_factory=dict)

    #: The environment variable of each field.
    ENVIRONMENT: ClassVar[dict[str, str]] = {
        "namespace": "KINETIC_NAMESPACE",
        "image": "KINETIC_IMAGE",
        "image_mode": "KINETIC_IMAGE_MODE",
        "requirements": "KINETIC_REQUIREMENTS",
        "registry": "KINETIC_REGISTRY",
        "service_account": "KINETIC_SERVICE_ACCOUNT",
        "context": "KINETIC_KUBE_CONTEXT",
        "coordinator_port": "KINETIC_COORDINATOR_PORT",
        "pending_timeout_s": "KINETIC_PENDING_TIMEOUT",
        "node_selector": "KINETIC_NODE_SELECTOR",
    }
    @property
    def channel_port(self) -> int:
        """Where a session's hub listens on host 0 (``runner.channel``): the port after the coordinator's."""
        return self.coordinator_port + 1

    def __post_init__(self) -> None:
        if not _DNS_LABEL.match(self.namespace or ""):
            raise ValueError(f"namespace {self.namespace!r} is not a valid Kubernetes namespace "
                             "(lowercase letters, digits and '-', at most 63)")
        if not 0 < self.coordinator_port < 65535:
            raise ValueError(f"coordinator port {self.coordinator_port} is not a TCP port below the last (1-65534: "
                             "a session's channel takes the next one)")
        if not self.pending_timeout_s > 0:
            raise ValueError(f"pending timeout must be positive, got {self.pending_timeout_s:g} s")
        if self.image is not None and (not self.image.strip() or any(c.isspace() for c in self.image)):
            raise ValueError(f"container image {self.image!r} is not an image reference")
        if self.image_mode is not None and self.image_mode not in {mode.value for mode in ImageMode}:
            raise ValueError(f"image mode {self.image_mode!r} is not one of "
                             f"{', '.join(mode.value for mode in ImageMode)}")
        if self.mode is ImageMode.CUSTOM and self.requirements:
            raise ValueError("--requirements needs --image-mode prebuilt or build: a custom image "
                             "is used as it is")

    @classmethod
    def resolve(cls, *, namespace: str | None = None, image: str | None = None, image_mode: str | None = None,
                requirements: str | None = None, registry: str | None = None, service_account: str | None = None, context: str | None = None,
                coordinator_port: int | None = None, pending_timeout_s: float | None = None,
                node_selector: Mapping[str, str] | None = None, config: KubernetesSettings | None = None,
                environ: Mapping[str, str] | None = None) -> KubernetesSettings:
        """Each field from its argument, else its ``KINETIC_*`` variable, else ``config``, else the default;
        where no context is named and keras-kinetic names a cluster (``kinetic_profile``), its context, and, unless
        named, its namespace and its ``kinetic`` service account.

        Parameters
        ----------
        namespace, image, image_mode, requirements, registry, service_account, context, coordinator_port, \
pending_timeout_s, node_selector
            Explicit values (the magic's flags); None means "not given".
        config : KubernetesSettings, optional
            What ``%config`` set; its fields rank below the environment.
        environ : mapping, optional
            The environment to read (default ``os.environ``).

        Raises
        ------
        ValueError
            One line naming the bad value and where it came from.
        """
        environ = os.environ if environ is None else environ
        given = {"namespace": namespace, "image": image, "image_mode": image_mode, "requirements": requirements,
                 "registry": registry, "service_account": service_account, "context": context,
                 "coordinator_port": coordinator_port, "pending_timeout_s": pending_timeout_s,
                 "node_selector": node_selector}
        values: dict[str, Any] = {}
        for field, value in given.items():
            variable = cls.ENVIRONMENT[field]
            if value is None and environ.get(variable, "").strip():
                value = _parse(field, variable, environ[variable].strip())
            if value is None and config is not None:
                value = getattr(config, field)
            if value is not None:
                values[field] = value
        target = kinetic_target(environ)
        if target is not None and "context" not in values:  # a cluster keras-kinetic's `kinetic up` made
            values["context"] = target.context
            values.setdefault("namespace", target.namespace)
            values.setdefault("service_account", KINETIC_SERVICE_ACCOUNT)
        return cls(**values)

    @property
    def mode(self) -> ImageMode:
        """The image mode: as set, else ``custom`` when an image is given, else ``prebuilt``."""
        if self.image_mode:
            return ImageMode(self.image_mode)
        return ImageMode.CUSTOM if self.image else ImageMode.PREBUILT

    def require_image(self) -> str:
        """The pods' image, or a one-line error naming the flag and the variable.

        ``prebuilt``: the image given, else the stock Python image; ``build``:
        the image given (the backend sets it to the built one); ``custom``: the
        image given.
        """
        if self.image:
            return self.image
        if self.mode is ImageMode.PREBUILT:
            return stock_image()
        if self.mode is ImageMode.BUILD:
            raise ValueError("the build image mode has no image until Cloud Build made it")
        raise ValueError("the custom image mode needs a container image with kinetic_nb installed: "
                         f"give image=IMAGE (--image in %%kinetic) or set {self.ENVIRONMENT['image']}, "
                         "or use --image-mode prebuilt")

    def require_image_base(self) -> str:
        """The image the build mode builds on: the image given, else the stock Python image."""
        return self.image or stock_image()

    def require_environment(self) -> None:
        """Refuse, in one line, settings whose mode lacks what it needs (before anything is stored)."""
        if self.mode is ImageMode.BUILD:
            if not self.registry:
                raise ValueError("the build image mode needs a registry for its images: give "
                                 f"--registry REGION-docker.pkg.dev/PROJECT/REPO or set {self.ENVIRONMENT['registry']}")
            if not self.requirements:
                raise ValueError("the build image mode builds an image from --requirements FILE: give one")
        else:
            self.require_image()


def _parse(field: str, variable: str, raw: str) -> Any:
    try:
        if field == "coordinator_port":
            return int(raw)
        if field == "pending_timeout_s":
            return float(raw)
        if field == "node_selector":
            pairs = [item.split("=", 1) for item in raw.split(",") if item.strip()]
            if any(len(pair) != 2 or not pair[0].strip() for pair in pairs):
                raise ValueError
            return {key.strip(): value.strip() for key, value in pairs}
    except ValueError:
        kind = {"coordinator_port": "a port number", "pending_timeout_s": "a number of seconds",
                "node_selector": "comma-separated key=value pairs"}[field]
        raise ValueError(f"{variable}={raw!r} is not {kind}") from None
    return raw
