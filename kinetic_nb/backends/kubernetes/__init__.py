"""The ``kubernetes`` backend: a job's hosts as GKE pods (a LeaderWorkerSet or an Indexed Job) under a root Job.

``backend`` is the backend itself; the rest are its parts: ``settings``,
``manifests`` and ``root`` (what is created), ``pods`` and ``events`` (what
the cluster says), ``image_modes`` and ``cloud_build`` (what the pods run;
what they install is :mod:`kinetic_nb.backends.host_environment`'s and
:mod:`kinetic_nb.backends.requirements`'), and ``doctor`` (is this notebook
ready for it).
"""
