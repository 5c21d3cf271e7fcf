"""What a cell reads from the notebook and how it travels to the hosts: capture, scope analysis, bindings."""
