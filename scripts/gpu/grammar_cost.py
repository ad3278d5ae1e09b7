"""What structured output costs: decode-step time, tokens/s and accept length of grammar-constrained batches against
free-text ones, speculation on and off, through the offline Engine on the real SmolLM2 with its MTP head.

    python3 scripts/gpu/grammar_cost.py --model-path /tmp/smollm2.gguf [--draft specserve/assets/smollm2-135m-mtp]
        [--batch-sizes 1,16] [--max-new-tokens 96] [--output-file grammar.jsonl]

Workloads, greedy: `free` (no rules: the one-graph steps), `json` (a JSON schema: a person with name, age, city and
hobbies), `tool` (a forced tool call: the server's tool_choice=required schema over two tools). Each runs once to
warm up, then timed; a step's time is the wall time over the decode steps the scheduler took (prefill included, the
same prompts in every workload). One JSON line per (engine, batch size, workload).
"""

from __future__ import annotations

import argparse
import json
import time

from specserve import Engine

PERSON = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"},
    "hobbies": {"type": "array", "items": {"type": "string"}, "maxItems": 4}},
    "required": ["name", "age", "city", "hobbies"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"]}}},
    {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}]
ASKS = ["Describe a person who lives in {} as JSON.", "What is the weather in {} right now?",
        "Tell me about a friend from {}."]
CITIES = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Delhi", "Quito", "Rome"]


def required_schema(tools: list[dict]) -> dict:
    """tool_choice=required's schema, as the chat route builds it (server/chat_tools.py, which needs the server's
    dependencies): one or more calls, each a tool's name and its parameters."""
    calls = [{"type": "object", "properties": {"name": {"enum": [t["function"]["name"]]},
                                               "parameters": t["function"]["parameters"]},
              "required": ["name", "parameters"]} for t in tools]
    return {"type": "array", "minItems": 1, "items": {"anyOf": calls}}


def prompts(engine: Engine, n: int) -> list[str]:
    return [engine.apply_chat_template([{"role": "user", "content": ASKS[i % 3].format(CITIES[i % 8])}])
            for i in range(n)]


def workload(name: str, max_new: int) -> dict:
    sp = {"temperature": 0.0, "max_new_tokens": max_new}
    if name == "json":
        sp["json_schema"] = json.dumps(PERSON)
    elif name == "tool":
        sp["json_schema"] = json.dumps(required_schema(TOOLS))
    return sp


def measure(engine: Engine, label: str, bs: int, name: str, max_new: int) -> dict:
    ps = prompts(engine, bs)
    sp = workload(name, max_new)
    engine.generate(ps, sp)  # warm-up (and the grammar compiled once: the compiler caches it)
    st = engine.core.scheduler.stats
    steps0, verify0, acc0 = st.num_decode_steps, st.spec_verify_ct, st.spec_accepted_drafts
    t0 = time.perf_counter()
    outs = engine.generate(ps, sp)
    wall = time.perf_counter() - t0
    steps = st.num_decode_steps - steps0
    verify = st.spec_verify_ct - verify0
    tokens = sum(len(o["output_ids"]) for o in outs)
    valid = sum(_parses(o["text"]) for o in outs) if name != "free" else None
    return {"engine": label, "bs": bs, "workload": name, "wall_s": round(wall, 4), "tokens": tokens,
            "decode_steps": steps, "ms_per_step": round(1e3 * wall / max(steps, 1), 3),
            "tokens_per_s": round(tokens / wall, 1),
            "accept_length": round((st.spec_accepted_drafts - acc0 + verify) / verify, 3) if verify else None,
            "valid_json": valid}


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", required=True, help="the SmolLM2 GGUF (or any checkpoint)")
    ap.add_argument("--draft", default="specserve/assets/smollm2-135m-mtp", help="the MTP head's folder")
    ap.add_argument("--batch-sizes", default="1,16", help="comma-separated batch sizes")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--num-steps", type=int, default=4, help="N draft tokens of the speculating engine")
    ap.add_argument("--output-file", default=None, help="append the JSON lines here too")
    a = ap.parse_args()
    engines = {"plain": {}, f"mtp_n{a.num_steps}": {
        "speculative_algorithm": "MTP", "speculative_draft_model_path": a.draft,
        "speculative_num_steps": a.num_steps}}
    rows = []
    for label, kw in engines.items():
        engine = Engine(model_path=a.model_path, context_length=2048, **kw)
        try:
            for bs in [int(x) for x in a.batch_sizes.split(",")]:
                for name in ("free", "json", "tool"):
                    row = measure(engine, label, bs, name, a.max_new_tokens)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        finally:
            engine.shutdown()
    if a.output_file:
        with open(a.output_file, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
