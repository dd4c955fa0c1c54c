"""The topology `kvplane plan` chose, written as a `kvplane deploy` file (docs/deploy.md).

Instances are packed onto nodes of the hardware profile's devices_per_node, prefill first,
each with its own HTTP port, side-channel port and GPUs; nodes are named `node-0`, `node-1`,
... for the operator to replace with addresses, and the model with a path or hub id. The file
is checked with the live room's own loader before it is written, so what `plan` writes,
`deploy` accepts.

Mode: the simulator's push or pull, or `bidirectional` when reuse was chosen (the live
router's bidirectional mode is pull legs plus the D->P reuse read).
"""

from __future__ import annotations

from typing import Any

import yaml  # type: ignore[import-untyped]

HTTP_PORT = 8100
SIDE_PORT = 5600


def topology(plan: dict[str, Any], scenario: Any, *, model: str | None = None) -> dict[str, Any]:
    """A deploy topology (dict) for `plan["chosen"]` under `scenario` (sim Scenario)."""
    chosen = plan["chosen"]
    if chosen is None:
        raise ValueError("no configuration met the SLO: nothing to deploy")
    c = chosen["candidate"]
    per_node = int(scenario.hardware.node.devices_per_node.value)
    ptp, dtp = int(plan["prefill_tp"]), int(plan["decode_tp"])
    roles = [("prefill", ptp)] * int(c["prefill"]) + [("decode", dtp)] * int(c["decode"])
    nodes: list[int] = []  # devices used per node
    instances = []
    for role, tp in roles:
        node = next((i for i, used in enumerate(nodes) if used + tp <= per_node), None)
        if node is None:
            nodes.append(0)
            node = len(nodes) - 1
        first = nodes[node]
        nodes[node] += tp
        on_node = sum(1 for inst in instances if inst["host"] == f"node-{node}")
        instances.append({
            "role": role, "host": f"node-{node}", "port": HTTP_PORT + on_node,
            "side_channel_port": SIDE_PORT + on_node, "tp": tp,
            "gpus": ",".join(str(g) for g in range(first, first + tp)),
        })
    eng = scenario.engine
    network = scenario.hardware.links.get("network") if not scenario.cluster.colocated else None
    efa = network is not None and "efa" in str(network.name).lower()
    routing = "kv_affinity" if c["bidirectional"] else scenario.cluster.routing
    return {
        "name": f"{plan['scenario']}-{c['prefill']}p{c['decode']}d".replace("_", "-"),
        "model": model or scenario.model.name,
        "mode": "bidirectional" if c["bidirectional"] else c["mode"],
        "nixl_backend": "LIBFABRIC" if efa else "UCX",
        "vllm_args": ["--max-model-len", str(eng.max_model_len),
                      "--max-num-seqs", str(eng.max_num_seqs),
                      "--max-num-batched-tokens", str(eng.max_num_batched_tokens),
                      "--block-size", str(eng.block_size),
                      "--gpu-memory-utilization", str(eng.gpu_memory_utilization)],
        "connector_extra": ({"decoder_kv_blocks_ttl": scenario.connector.decoder_kv_blocks_ttl,
                             "kv_recompute_threshold": scenario.connector.kv_recompute_threshold}
                            if c["bidirectional"] else {}),
        "router": {"host": "node-0", "port": 8000, "policy": routing},
        "instances": instances,
    }


def render(plan: dict[str, Any], topo: dict[str, Any]) -> str:
    w, ch = plan["workload"], plan["chosen"]
    head = [
        f"# kvplane deploy topology written by `kvplane plan {plan['scenario']}`",
        (f"# chosen: {ch['label']} on {ch['gpus']} GPUs, planned for {w['rate']:g} "
         f"{w['rate_unit']}, input {w['input_len']}, output {w['output_len']} tokens,"),
        (f"#   SLO p90 TTFT <= {plan['slo']['ttft_p90_ms']:g} ms, p90 TPOT <= "
         f"{plan['slo']['tpot_p90_ms']:g} ms"),
        "# replace node-N with the nodes' addresses and `model` with a path or hub id, then:",
        "#   kvplane deploy THIS_FILE --format script --out serve.sh",
    ]
    return "\n".join(head) + "\n" + yaml.safe_dump(topo, sort_keys=False)
