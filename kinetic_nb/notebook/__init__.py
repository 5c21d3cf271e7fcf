"""The notebook face: the ``%%kinetic`` and ``%kinetic`` magics (parse, call the client, show) and the display.

Imports the client and the display, never a backend: what a backend adds to
the magics (its flags, its ``%config`` settings) comes through the client.
"""
