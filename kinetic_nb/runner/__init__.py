"""The host side: what runs on every host of a slice.

Host-safe: this package imports only the standard library, cloudpickle,
``kinetic_nb.errors`` and ``kinetic_nb.storage`` (and jax or torch when the
plan asks for them). Run it as ``python -m kinetic_nb.runner --job URI``.
"""
