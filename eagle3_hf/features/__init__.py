"""Every way to get the verifier's hidden states, in one place (see the module docstring of interface.py)."""
