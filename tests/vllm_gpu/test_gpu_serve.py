"""``vllm serve`` (CUDA) with the plugin enabled by one variable answers an OpenAI client on 127.0.0.1."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

from gpu_helpers import GPU_SHARE, KV_BYTES, long_text, read_trace, worker_env

from kvlocks.config import LocksConfig
from kvlocks.integrations.vllm.settings import PluginSettings, to_text
from kvlocks.models import resolve


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_vllm_serve_with_plugin_answers_openai_client(tmp_path):
    import openai

    port = _free_port()
    trace = tmp_path / "trace.jsonl"
    env = {**worker_env(), "KVLOCKS_VLLM_TRACE": str(trace),
           "KVLOCKS_VLLM_CONFIG": to_text(LocksConfig(budget=64), PluginSettings(dense_below=0))}
    # `vllm serve` is vllm.entrypoints.cli.main; eager, so that the trace records the decode steps
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(resolve("smollm2-135m")),
           "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "smollm2", "--dtype", "bfloat16",
           "--max-model-len", "2048", "--gpu-memory-utilization", str(GPU_SHARE),
           "--kv-cache-memory-bytes", str(KV_BYTES), "--enforce-eager"]
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=120)
        deadline = time.time() + 400
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-4000:]
            try:
                models = client.models.list()
                break
            except openai.APIConnectionError:
                assert time.time() < deadline, "vllm serve did not come up in 400 s"
                time.sleep(3)
        assert [m.id for m in models.data] == ["smollm2"]
        prompt = long_text(40)  # ~700 tokens: 44 pages, budget 4 pages -> LOCKS decode
        done = client.completions.create(model="smollm2", prompt=prompt, max_tokens=12, temperature=0)
        assert done.choices[0].text.strip()
        recs = read_trace(trace)
        assert recs, "no LOCKS decode step ran inside vllm serve"
        assert {r["layer"] for r in recs} == set(range(30))
        assert all(len(p) == 4 for r in recs for p in r["pages"])
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
