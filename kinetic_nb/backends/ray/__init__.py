"""The ``ray`` backend: a job's hosts as Ray actors, one per node (``backend``), placed by ``placement``."""
