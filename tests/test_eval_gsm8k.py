"""GSM8K eval pieces without a server: loading, answer extraction, prompts, request bodies, shot split, summary."""

import argparse
import json
import os

import pytest
from helpers import shared_data_dir

from specserve.bench import gsm8k
from specserve.bench.eval_cli import _split_shots

EXAMPLES = [
    {"question": f"What is {a} plus {b}?", "answer": f"{a} + {b} = <<{a}+{b}={a + b}>>{a + b}.\n#### {a + b}"}
    for a, b in ((1, 2), (3, 4), (10, 20), (1200, 34), (5, 5))
]


@pytest.fixture
def data_file(tmp_path):
    p = tmp_path / "gsm8k.jsonl"
    p.write_text("\n".join(json.dumps(e) for e in EXAMPLES) + "\n")
    return str(p)


@pytest.mark.parametrize("text,expected", [
    ("so 9 * 2 = 18\n#### 18", 18.0),
    ("#### 1,234", 1234.0),
    ("#### $5.50 dollars, 7 cents", 5.5),
    ("She has 3 apples and 4 pears. The answer is 7. Then 99 more.", 7.0),  # "answer is" beats the last number
    ("The answer is: $2,000.", 2000.0),
    ("First 12, then 15, so 20 in total", 20.0),
    ("the temperature dropped to -4 degrees", -4.0),
    ("#### 42 ... the answer is 41, and 40", 42.0),  # "####" beats everything
    ("#### none; but the answer is 6", 6.0),  # "####" without a number falls through
    ("I cannot tell.", None),
    ("", None),
])
def test_extract_answer(text, expected):
    assert gsm8k.extract_answer(text) == expected


def test_is_correct():
    assert gsm8k.is_correct(18.0, 18.0) and gsm8k.is_correct(18.0000000001, 18.0)
    assert not gsm8k.is_correct(17.0, 18.0) and not gsm8k.is_correct(None, 18.0)


def test_load_and_gold(data_file, tmp_path):
    ex = gsm8k.load_gsm8k(data_file)
    assert [e.gold for e in ex] == [3, 7, 30, 1234, 10]
    assert ex[0].solution("####") == "1 + 2 = 3.\n#### 3"  # calculator annotation removed
    assert ex[0].solution("answer is") == "1 + 2 = 3.\nThe answer is 3."
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "answer": "no final line"}) + "\n")
    with pytest.raises(ValueError, match="####"):
        gsm8k.load_gsm8k(str(bad))


def test_completion_prompt(data_file):
    ex = gsm8k.load_gsm8k(data_file)
    prompt = gsm8k.completion_prompt(ex[:3], "How many?")
    assert prompt.count("Question:") == 4 and prompt.endswith("Question: How many?\nAnswer:")
    assert prompt.startswith("Question: What is 1 plus 2?\nAnswer: 1 + 2 = 3.\n#### 3\n\n")
    assert "<<" not in prompt
    assert gsm8k.completion_prompt([], "Q?") == "Question: Q?\nAnswer:"


def test_chat_messages(data_file):
    ex = gsm8k.load_gsm8k(data_file)
    msgs = gsm8k.chat_messages(ex[:2], "How many?")
    assert [m["role"] for m in msgs] == ["user", "assistant", "user", "assistant", "user"]
    assert msgs[-1]["content"].endswith("How many?") and "The answer is N" in msgs[-1]["content"]
    assert msgs[1]["content"].endswith("The answer is 3.")
    assert len(gsm8k.chat_messages([], "Q?")) == 1


def test_request_body_per_api():
    cfg = gsm8k.EvalConfig(base_url="http://x", api="completion", model="m", max_tokens=64)
    route, body = gsm8k.request_body(cfg, [], "Q?")
    assert route == "/v1/completions" and body["stop"] == ["Question:"] and body["max_tokens"] == 64
    assert body["temperature"] == 0.0 and body["model"] == "m"
    cfg = gsm8k.EvalConfig(base_url="http://x", api="chat", model="m", chat_template_kwargs={"enable_thinking": False})
    route, body = gsm8k.request_body(cfg, [], "Q?")
    assert route == "/v1/chat/completions" and "stop" not in body
    assert body["chat_template_kwargs"] == {"enable_thinking": False} and body["messages"][-1]["role"] == "user"


def test_response_text():
    assert gsm8k.response_text("completion", {"choices": [{"text": " 4\n#### 4"}]}) == " 4\n#### 4"
    assert gsm8k.response_text("chat", {"choices": [{"message": {"content": "The answer is 2."}}]}) == \
        "The answer is 2."
    assert gsm8k.response_text("chat", {"choices": [{"message": {"content": None,
                                                                 "reasoning_content": "so 5"}}]}) == "so 5"


def _args(**kw):
    base = dict(num_shots=None, api="completion", shots_data=None, num_examples=None)
    base.update(kw)
    return argparse.Namespace(**base)


def test_split_shots_never_evaluates_a_shot(data_file, tmp_path):
    ex = gsm8k.load_gsm8k(data_file)
    shots, evals = _split_shots(_args(num_shots=2), ex)
    assert shots == ex[:2] and evals == ex[2:]
    shots, evals = _split_shots(_args(api="chat"), ex)  # chat default: zero-shot
    assert shots == [] and evals == ex
    shots, evals = _split_shots(_args(num_shots=1, num_examples=2, shots_data=data_file), ex)
    assert shots == ex[:1] and evals == ex[:2]  # shots from another file: the data file is evaluated from its start
    with pytest.raises(ValueError):
        _split_shots(_args(), ex)  # default 5 shots leave nothing to evaluate


def test_summarize_counts():
    R = gsm8k.ExampleResult
    results = [R(pred=3.0, correct=True, completion_tokens=10, accept_length=2.0, verify_ct=5),
               R(pred=4.0, correct=False, completion_tokens=20, accept_length=4.0, verify_ct=15),
               R(pred=None, correct=False, completion_tokens=30),
               R(error="HTTP 500")]
    s = gsm8k.summarize(results, latency=2.0)
    assert s["num_examples"] == 4 and s["correct"] == 1 and s["accuracy"] == 0.25
    assert s["num_invalid"] == 1 and s["invalid"] == 0.25 and s["failed"] == 1
    assert s["output_tokens"] == 60 and s["output_throughput"] == 30.0
    assert s["accept_length"] == pytest.approx((2.0 * 5 + 4.0 * 15) / 20)


def test_shared_gsm8k_test_set_parses():
    data = shared_data_dir()
    path = os.path.join(data, "gsm8k", "test.jsonl") if data else None
    if not path or not os.path.exists(path):
        pytest.skip("shared gsm8k data not present")
    ex = gsm8k.load_gsm8k(path)
    assert len(ex) > 1000
    for e in ex:
        raw = e.answer.rpartition("####")[2].strip().replace(",", "")
        assert e.gold == float(raw)
        assert "<<" not in e.solution() and e.solution().endswith(f"#### {e.answer.rpartition('####')[2].strip()}")
