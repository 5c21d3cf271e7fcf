"""The ``ssh`` backend (in progress): machines reached with the user's own OpenSSH setup, host 0 first."""
