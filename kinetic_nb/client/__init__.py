"""Cells and hosts as the notebook sees them: launching, handles, the poller, the outcome rules, the catalog.

Plain Python, no IPython: the magics are a thin layer over it, and the
package root exports its public part (``kinetic_nb.submit``, ``start``, ...).
It never imports the display: a handle is shown through ``kinetic_nb.views``.
"""
