"""`kvplane deploy`: a topology to exact command lines and a bash script (1P1D over UCX on one
node, and 1P1D over EFA with NIXL's LIBFABRIC backend on two nodes), and `kvplane router`'s
command line."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml
from typer.testing import CliRunner

from kvplane.cli_live import register
from kvplane.live.deploy import (
    TopologyError,
    load_topology,
    plan,
    render_commands,
    render_json,
    render_script,
)

UCX_1P1D = """
name: tiny-1p1d
model: /models/Qwen3-0.6B
served_model_name: qwen3-0.6b
mode: push
nixl_backend: UCX
ucx_tls: cuda_ipc,cuda_copy,tcp
vllm_args: [--max-model-len, "32768", --max-num-seqs, "8", --enforce-eager]
router: {host: 127.0.0.1, port: 8000, policy: least_loaded}
instances:
  - {role: prefill, host: 127.0.0.1, port: 8100, side_channel_port: 5600, gpus: "0"}
  - {role: decode, host: 127.0.0.1, port: 8200, side_channel_port: 5601, gpus: "1"}
"""

EFA_1P1D = """
name: qwen3-32b-efa
model: Qwen/Qwen3-32B
mode: bidirectional
nixl_backend: LIBFABRIC
launcher: module
python: /opt/venv/bin/python
env: {HF_HUB_OFFLINE: "1"}
vllm_args: [--max-model-len, "32768", --max-num-seqs, "8", --no-enable-prefix-caching]
router: {host: 10.0.0.2, port: 8000}
instances:
  - role: prefill
    host: 10.0.0.2
    port: 8100
    side_channel_port: 5600
    tp: 8
    gpus: "0,1,2,3,4,5,6,7"
  - role: decode
    host: 10.0.0.3
    port: 8100
    side_channel_port: 5600
    tp: 8
    gpus: "0,1,2,3,4,5,6,7"
    env: {FI_EFA_FORK_SAFE: "1"}
"""


def topo(text: str, **changes: Any) -> Any:
    raw = yaml.safe_load(text)
    raw.update(changes)
    return load_topology(raw)


def test_ucx_1p1d_command_lines() -> None:
    t = topo(UCX_1P1D)
    prefill, decode, router = plan(t)
    env = dict(prefill.env)
    assert env["CUDA_VISIBLE_DEVICES"] == "0"
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5600"
    assert dict(decode.env)["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5601"  # one per instance
    assert env["UCX_TLS"] == "cuda_ipc,cuda_copy,tcp" and "FI_PROVIDER" not in env
    # the instances take only the router's API key, which reaches both from the environment
    assert env["VLLM_API_KEY"] == "$KVPLANE_UPSTREAM_API_KEY"
    assert dict(router.env)["KVPLANE_UPSTREAM_API_KEY"] == "$KVPLANE_UPSTREAM_API_KEY"
    argv = list(prefill.argv)
    assert argv[:3] == ["vllm", "serve", "/models/Qwen3-0.6B"]
    assert argv[argv.index("--port") + 1] == "8100"
    assert argv[argv.index("--tensor-parallel-size") + 1] == "1"
    assert argv[argv.index("--served-model-name") + 1] == "qwen3-0.6b"
    kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert kv == {
        "kv_connector": "KvplaneConnector",
        "kv_connector_module_path": "kvplane.live.connector",
        "kv_role": "kv_both",
        "kv_buffer_device": "cuda",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "instance": "prefill-0", "side_channel_host": "127.0.0.1",
            "side_channel_port": 5600, "bidirectional_kv_xfer": False, "backends": ["UCX"],
        },
    }
    assert argv[-5:] == ["--max-model-len", "32768", "--max-num-seqs", "8", "--enforce-eager"]
    assert "--no-enable-prefix-caching" not in argv  # vLLM's default (on) is kept
    r = list(router.argv)
    assert r[:2] == ["kvplane", "router"]
    assert r[r.index("--mode") + 1] == "push" and r[r.index("--policy") + 1] == "least_loaded"
    assert r[r.index("--prefill") + 1] == "http://127.0.0.1:8100,id=prefill-0,side=127.0.0.1:5600"
    assert r[r.index("--decode") + 1] == "http://127.0.0.1:8200,id=decode-0,side=127.0.0.1:5601"
    assert r[r.index("--model") + 1] == "qwen3-0.6b"
    # the printed line is the argv, shell-quoted, after its environment
    line = prefill.command()
    assert line.startswith("CUDA_VISIBLE_DEVICES=0 VLLM_NIXL_SIDE_CHANNEL_HOST=127.0.0.1 ")
    assert 'KVPLANE_DB="$KVPLANE_DB"' in line  # secrets stay in the operator's environment
    words = shlex.split(line)
    assert words[words.index("vllm"):] == argv
    text = render_commands(t)
    assert "# --- node 127.0.0.1" in text and text.count("vllm serve") == 2
    assert json.loads(render_json(t))["processes"][2]["argv"] == r


def test_ucx_1p1d_script_waits_for_health_and_is_valid_bash(tmp_path: Path) -> None:
    script = render_script(topo(UCX_1P1D))
    assert script.startswith("#!/usr/bin/env bash\n")
    assert "set -euo pipefail" in script
    assert 'until curl -sf -o /dev/null "$url"; do' in script
    assert "wait_for_health http://127.0.0.1:8100/health prefill-0" in script
    assert "wait_for_health http://127.0.0.1:8200/health decode-0" in script
    # the router starts only after every instance is healthy
    router_block = script[script.index("if on_node 127.0.0.1; then\n  # every instance"):]
    assert router_block.index("wait_for_health http://127.0.0.1:8200/health") < \
        router_block.index("starting the router")
    assert "trap cleanup INT TERM EXIT" in script
    path = tmp_path / "serve.sh"
    path.write_text(script)
    bash = shutil.which("bash")
    assert bash is not None
    subprocess.run([bash, "-n", str(path)], check=True)  # parses


def test_efa_topology_two_nodes_libfabric() -> None:
    t = topo(EFA_1P1D)
    prefill, decode, router = plan(t)
    for proc, host in ((prefill, "10.0.0.2"), (decode, "10.0.0.3")):
        env = dict(proc.env)
        assert env["FI_PROVIDER"] == "efa" and env["FI_EFA_USE_DEVICE_RDMA"] == "1"
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == host  # peers on the other node reach it
        assert env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"
        assert env["HF_HUB_OFFLINE"] == "1"
        argv = list(proc.argv)
        assert argv[:5] == ["/opt/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server",
                            "--model", "Qwen/Qwen3-32B"]
        assert argv[argv.index("--tensor-parallel-size") + 1] == "8"
        assert argv[argv.index("--host") + 1] == host
        extra = json.loads(argv[argv.index("--kv-transfer-config") + 1])[
            "kv_connector_extra_config"]
        assert extra["backends"] == ["LIBFABRIC"] and extra["bidirectional_kv_xfer"] is True
        assert argv.count("--no-enable-prefix-caching") == 1  # given once, not added again
    assert dict(decode.env)["FI_EFA_FORK_SAFE"] == "1"
    assert router.host == "10.0.0.2" and "--mode" in router.argv
    assert router.argv[router.argv.index("--policy") + 1] == "kv_affinity"
    text = render_commands(t)
    assert "# --- node 10.0.0.2" in text and "# --- node 10.0.0.3" in text
    assert "# note: LIBFABRIC" in text
    script = render_script(t)
    assert "if on_node 10.0.0.3; then" in script
    assert "wait_for_health http://10.0.0.3:8100/health decode-0" in script


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"instances": [
            {"role": "prefill", "host": "h", "port": 8100, "side_channel_port": 5600},
            {"role": "decode", "host": "h", "port": 8200, "side_channel_port": 5600}]},
         "uses port 5600 on h, already taken by prefill-0 (side channel)"),
        ({"instances": [
            {"role": "prefill", "host": "h", "port": 8100, "side_channel_port": 5600, "tp": 2,
             "gpus": "0"},
            {"role": "decode", "host": "h", "port": 8200, "side_channel_port": 5601,
             "gpus": "0"}]},
         "tp 2 needs 2 GPUs"),
        ({"instances": [
            {"role": "decode", "host": "h", "port": 8100, "side_channel_port": 5600},
            {"role": "decode", "host": "h", "port": 8200, "side_channel_port": 5601}]},
         "at least one prefill instance is needed"),
        ({"instances": [
            {"role": "prefill", "host": "0.0.0.0", "port": 8100, "side_channel_port": 5600},
            {"role": "decode", "host": "h", "port": 8200, "side_channel_port": 5601}]},
         "prefill-0: host '0.0.0.0' listens on every interface"),
        ({"mode": "sideways"}, "mode"),
        ({"nixl_backend": "GDS"}, "nixl_backend"),
    ],
)
def test_bad_topologies_are_refused_with_every_reason(change: dict[str, Any],
                                                      message: str) -> None:
    with pytest.raises(TopologyError, match=message.replace("(", r"\(").replace(")", r"\)")):
        topo(UCX_1P1D, **change)


def _cli() -> typer.Typer:
    app = typer.Typer()

    @app.callback()
    def main() -> None:
        """kvplane (test copy)."""

    register(app)
    return app


def test_deploy_command(tmp_path: Path) -> None:
    path = tmp_path / "topo.yaml"
    path.write_text(EFA_1P1D)
    runner = CliRunner()
    result = runner.invoke(_cli(), ["deploy", str(path)])
    assert result.exit_code == 0, result.output
    assert "--kv-transfer-config" in result.output and "FI_PROVIDER=efa" in result.output
    out = tmp_path / "serve.sh"
    result = runner.invoke(_cli(), ["deploy", str(path), "--format", "script", "--out", str(out)])
    assert result.exit_code == 0 and out.stat().st_mode & 0o111
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: x\nrouter: {host: h}\ninstances: []\n")
    result = runner.invoke(_cli(), ["deploy", str(bad)])
    assert result.exit_code == 2 and "instances" in result.output


def test_router_command_line_is_checked() -> None:
    runner = CliRunner()
    result = runner.invoke(_cli(), ["router", "--help"])
    assert result.exit_code == 0 and "--prefill" in result.output
    result = runner.invoke(_cli(), ["router", "--prefill", "http://h:1", "--decode", "ftp://x",
                                    "--mode", "sideways", "--no-record"])
    assert result.exit_code == 2
    assert "mode must be one of" in result.output and "decode-0: url 'ftp://x'" in result.output


FAKE_SERVER = """#!{python}
# stands in for `vllm serve` and `kvplane router` in the script test: answers /health on --port
import http.server, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def _free_ports(n: int) -> list[int]:
    import kvplane_live_servers

    return [kvplane_live_servers.free_port() for _ in range(n)]


def test_script_starts_everything_and_waits_for_health(tmp_path: Path) -> None:
    """Run the generated script with stand-in `vllm` and `kvplane` commands on PATH."""
    import os
    import signal
    import sys

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("vllm", "kvplane"):
        exe = bin_dir / name
        exe.write_text(FAKE_SERVER.format(python=sys.executable))
        exe.chmod(0o755)
    pp, dp, rp, s1, s2 = _free_ports(5)
    raw = yaml.safe_load(UCX_1P1D)
    raw["router"] = {"host": "127.0.0.1", "port": rp}
    raw["instances"] = [
        {"role": "prefill", "host": "127.0.0.1", "port": pp, "side_channel_port": s1},
        {"role": "decode", "host": "127.0.0.1", "port": dp, "side_channel_port": s2},
    ]
    raw["health_timeout"] = 20
    script = tmp_path / "serve.sh"
    script.write_text(render_script(load_topology(raw)))
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "KVPLANE_DB": "sqlite://",
           "KVPLANE_RUN": "r", "KVPLANE_HANDLE_KEY": "k" * 32, "LOG_DIR": str(tmp_path / "logs"),
           "KVPLANE_UPSTREAM_API_KEY": "u" * 32}
    proc = subprocess.Popen(["bash", str(script), "all"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("all up"):
                break
        out = "".join(lines)
        assert "prefill-0 is healthy" in out and "decode-0 is healthy" in out, out
        assert "router is healthy" in out, out
        assert out.index("decode-0 is healthy") < out.index("starting the router")
    finally:
        proc.send_signal(signal.SIGTERM)  # the script's trap stops what it started
        proc.wait(timeout=10)
    import urllib.error
    import urllib.request

    for port in (pp, dp, rp):
        with pytest.raises(urllib.error.URLError):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
