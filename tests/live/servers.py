"""Start and stop real vLLM servers (CPU build) as subprocesses for the live tests.

- `VllmServer` runs `python -m vllm.entrypoints.openai.api_server` in its own process group with
  its own log file, waits for `/health`, and stops the whole group (SIGTERM, then SIGKILL).
- `start_all` starts several servers at once and waits for all (on 2 cores a P/D pair takes
  about a minute, three servers about two), failing with the tail of the log of any server
  that died or never became healthy.
- `PdClient` plays the router's part of the request contract (docs/notes/live-protocol.md):
  pull (prefill, then decode with prefill's params), push (both legs at once, one transfer id)
  and reuse (prefill gets the previous turn's retained handle). Completions API with token ids
  in and out, temperature 0.

Settings that matter on this machine (shared/LIVE-ON-CPU.md): float32 (bf16 hit an AMX illegal
instruction in a P/D decode worker), `VLLM_CPU_KVCACHE_SPACE=1`, `--enforce-eager`, one side
channel port per server, `HF_HUB_OFFLINE=1`, prefix caching off (the recorded ledger gives each
block one owner).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

MODEL_NAME = "tiny"


def require_vllm() -> None:
    """Fail (never skip) when vLLM's CPU build is not importable here, saying how to fix it."""
    import importlib.util

    import pytest

    if importlib.util.find_spec("vllm") is None:
        pytest.fail("vLLM is not installed in this interpreter: the live connector tests run "
                    "real vLLM servers and are never skipped. Run `make setup-live` (or "
                    "`bash scripts/install_live.sh .venv`) and use that venv's python.",
                    pytrace=False)


def log_dir(suite: str) -> Path:
    """Where a suite's server logs and event database go: kept after the run (pytest's own
    temporary folders are rotated away by later runs), under $KVPLANE_TEST_LOGS or the
    temporary folder."""
    import tempfile

    base = Path(os.environ.get("KVPLANE_TEST_LOGS",
                               Path(tempfile.gettempdir()) / "kvplane-live-logs"))
    path = base / f"{suite}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class VllmServer:
    name: str
    model: Path
    log_dir: Path
    connector: dict[str, Any] | None = None  # kv_connector_extra_config; None: no connector
    port: int = field(default_factory=free_port)
    side_port: int = field(default_factory=free_port)
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"{self.name}.log"

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(self.model), "--served-model-name", MODEL_NAME,
               "--host", "127.0.0.1", "--port", str(self.port),
               "--dtype", "float32", "--enforce-eager", "--max-model-len", "512",
               "--max-num-seqs", "4", "--block-size", "32", "--no-enable-prefix-caching",
               *self.extra_args]
        if self.connector is not None:
            extra = {"instance": self.name, "side_channel_port": self.side_port,
                     **self.connector}
            cmd += ["--kv-transfer-config", json.dumps({
                "kv_connector": "KvplaneConnector",
                "kv_connector_module_path": "kvplane.live.connector",
                "kv_role": "kv_both", "kv_buffer_device": "cpu",
                "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": extra})]
        return cmd

    def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
               "VLLM_NIXL_SIDE_CHANNEL_PORT": str(self.side_port),
               "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
               "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1",
               "VLLM_LOGGING_LEVEL": "INFO", "PYTHONUNBUFFERED": "1", **self.env}
        log = open(self.log_path, "ab")  # noqa: SIM115 - closed with the process
        log.write(f"$ {' '.join(self.command())}\n".encode())
        log.flush()
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                     env=env, start_new_session=True)

    def healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"vLLM server {self.name} exited with "
                                   f"{self.proc.returncode if self.proc else '?'}:\n"
                                   f"{self.log_tail()}")
            if self.healthy():
                return
            time.sleep(1.0)
        raise RuntimeError(f"vLLM server {self.name} not healthy after {timeout:.0f} s:\n"
                           f"{self.log_tail()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=10)

    def kill(self) -> None:
        """SIGKILL the whole process group at once (a crash, for fault tests)."""
        self.stop(signal.SIGKILL, timeout=10)

    def metrics(self) -> dict[str, float]:
        """`/metrics` as {name{labels}: value}, summed over engines."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        out: dict[str, float] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            name, _, value = line.rpartition(" ")
            try:
                out[name] = out.get(name, 0.0) + float(value)
            except ValueError:
                continue
        return out

    def metric(self, prefix: str, **labels: str) -> float:
        """Sum of every sample whose name starts with `prefix` and has the given labels."""
        total = 0.0
        for key, value in self.metrics().items():
            name = key.split("{", 1)[0]
            if name != prefix:
                continue
            if all(f'{k}="{v}"' in key for k, v in labels.items()):
                total += value
        return total


def start_all(servers: list[VllmServer], timeout: float = 420.0) -> None:
    for s in servers:
        s.start()
    try:
        with cf.ThreadPoolExecutor(len(servers)) as pool:
            for f in [pool.submit(s.wait_ready, timeout) for s in servers]:
                f.result()
    except BaseException:
        stop_all(servers)
        raise


def stop_all(servers: list[VllmServer]) -> None:
    threads = [threading.Thread(target=s.stop) for s in servers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


# ---- the router's part, for the tests -----------------------------------------------------------


@dataclass
class Completion:
    token_ids: list[int]
    text: str
    kv_transfer_params: dict[str, Any] | None
    raw: dict[str, Any]


def complete(url: str, prompt: list[int], max_tokens: int,
             kv_transfer_params: dict[str, Any] | None = None, *,
             request_id: str | None = None, timeout: float = 120.0) -> Completion:
    body: dict[str, Any] = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
                            "temperature": 0.0, "ignore_eos": True, "return_token_ids": True,
                            "stream": False}
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    headers = {"X-Request-Id": request_id} if request_id else {}
    r = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=timeout)
    r.raise_for_status()
    data = r.json()
    choice = data["choices"][0]
    return Completion(list(choice.get("token_ids") or []), choice.get("text", ""),
                      data.get("kv_transfer_params"), data)


@dataclass
class PdClient:
    """The router's side of the contract, minimal: one prefill, one decode."""

    prefill: VllmServer
    decode: VllmServer

    def prefill_source(self) -> dict[str, Any]:
        return {"instance": self.prefill.name, "host": "127.0.0.1",
                "port": self.prefill.side_port}

    def pull(self, prompt: list[int], max_tokens: int, *, retain: bool = False,
             retain_ttl: float | None = None, reuse: dict[str, Any] | None = None,
             xfer: str | None = None) -> tuple[Completion, Completion]:
        xfer = xfer or f"pull-{uuid.uuid4().hex[:12]}"
        kp: dict[str, Any] = {"v": 1, "mode": "pull", "xfer": xfer}
        if reuse is not None:
            kp["reuse"] = reuse
        p = complete(self.prefill.url, prompt, 1, {"do_remote_decode": True, "kvplane": kp},
                     request_id=xfer)
        params = p.kv_transfer_params
        assert params and params.get("kvplane"), f"prefill returned no kvplane params: {p.raw}"
        params["kvplane"]["retain"] = retain
        if retain_ttl is not None:
            params["kvplane"]["retain_ttl"] = retain_ttl
        d = complete(self.decode.url, prompt, max_tokens, params, request_id=xfer)
        return p, d

    def push(self, prompt: list[int], max_tokens: int, *, retain: bool = False,
             retain_ttl: float | None = None, reuse: dict[str, Any] | None = None,
             xfer: str | None = None, order: str = "together",
             lead: float = 0.5) -> tuple[Completion, Completion]:
        """Both legs, sharing one transfer id. `order`: "together" (both at once),
        "registration_first" (decode's leg `lead` seconds ahead), "prefill_first" (prefill's
        leg answered before decode's is sent: prefill holds its blocks for the registration)."""
        xfer = xfer or f"push-{uuid.uuid4().hex[:12]}"
        pk: dict[str, Any] = {"v": 1, "mode": "push", "xfer": xfer}
        if reuse is not None:
            pk["reuse"] = reuse
        dk: dict[str, Any] = {"v": 1, "mode": "push", "xfer": xfer,
                              "source": self.prefill_source(), "retain": retain}
        if retain_ttl is not None:
            dk["retain_ttl"] = retain_ttl
        p_params = {"do_remote_decode": True, "kvplane": pk}
        d_params = {"do_remote_prefill": True, "kvplane": dk}
        if order == "prefill_first":
            p = complete(self.prefill.url, prompt, 1, p_params, request_id=xfer)
            return p, complete(self.decode.url, prompt, max_tokens, d_params, request_id=xfer)
        with cf.ThreadPoolExecutor(2) as pool:
            fd = pool.submit(complete, self.decode.url, prompt, max_tokens, d_params,
                             request_id=xfer)
            if order == "registration_first":
                time.sleep(lead)
            fp = pool.submit(complete, self.prefill.url, prompt, 1, p_params, request_id=xfer)
            return fp.result(), fd.result()
