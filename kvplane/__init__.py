"""kvplane: the control plane for vLLM prefill/decode disaggregation.

Rooms (see ARCHITECTURE.md): core (sans-IO protocol), store (event store), sim (SimPy driver),
live (vLLM connector, NIXL transport, router), dashboard (Streamlit), scenarios (YAML data).
"""

__version__ = "0.1.0"
