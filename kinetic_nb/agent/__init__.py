"""The host agent: the same supervision of a job's hosts on every backend.

``python -m kinetic_nb.agent --job URI`` runs this host's part of the job (the
host index comes from the platform's variables, as the runner reads them) and
supervises it: logs, exit record, grace after a failure, the plan's timeout,
cancel, stacks on request, outputs. ``--all-hosts`` makes one agent run every
host of the job (the local backend); ``--watch`` only waits for the job to
end (a cluster's root object, which takes the workload with it).

Host-safe: the standard library, the runner and storage only.
"""
