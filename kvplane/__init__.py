"""kvplane: the control plane for vLLM prefill/decode disaggregation.

Rooms: core (sans-IO protocol), store (event store), sim (SimPy driver), live (vLLM connector,
NIXL transport, router), dashboard (Streamlit), scenarios (YAML data); the import rules between
them are checked by tests/test_architecture.py.
"""

__version__ = "0.1.0"
