#!/usr/bin/env python3
"""Structured outputs through the `openai` Python client, as users call them.

Against a running server (`pdkv serve` or the proxy of `pdkv up`):
JSON-schema answers at temperature 1 (plain, n=4, streamed) validated with
`jsonschema`, regex and choice constraints matched, and a three-turn
conversation whose answers follow a schema. Prints a summary per check and
exits non-zero when any output breaks its constraint.

    python3 -m venv /tmp/v && /tmp/v/bin/pip install openai jsonschema
    /tmp/v/bin/python scripts/structured-check.py --base-url http://127.0.0.1:8000/v1
"""

import argparse
import concurrent.futures
import json
import re
import sys

import jsonschema
from openai import OpenAI

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"type": "string", "enum": ["admin", "editor", "viewer"]},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20}, "minItems": 1, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "hobbies", "address"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "strict": True, "schema": SCHEMA}}
ASK = [{"role": "user", "content": "Describe a made-up person as JSON: name, age, role, hobbies and address."}]


def check_json(text):
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
        return None
    except Exception as e:  # noqa: BLE001 - any failure is a broken output
        return f"{type(e).__name__}: {str(e)[:200]}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--model", default=None, help="default: the server's first model")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=400)
    a = ap.parse_args()
    client = OpenAI(base_url=a.base_url, api_key="unused", timeout=600)
    model = a.model or client.models.list().data[0].id
    failures = []

    def report(name, outputs):
        bad = [(t, e) for t, e in outputs if e]
        print(f"{name}: {len(outputs) - len(bad)}/{len(outputs)} follow their constraint")
        for t, e in bad[:3]:
            print(f"  broken: {e}: {t[:300]!r}")
        failures.extend(bad)

    def one(seed):
        r = client.chat.completions.create(model=model, messages=ASK, response_format=FORMAT,
                                           temperature=1.0, seed=seed, max_tokens=a.max_tokens)
        c = r.choices[0]
        err = check_json(c.message.content) or (None if c.finish_reason == "stop" else f"finish {c.finish_reason}")
        return c.message.content, err

    with concurrent.futures.ThreadPoolExecutor(a.concurrency) as pool:
        report("json_schema, temperature 1", list(pool.map(one, range(a.requests))))

        def group(seed):
            r = client.chat.completions.create(model=model, messages=ASK, response_format=FORMAT, n=4,
                                               temperature=1.0, seed=1000 + seed, max_tokens=a.max_tokens)
            return [(c.message.content, check_json(c.message.content)) for c in r.choices]

        report("json_schema, n=4", [o for g in pool.map(group, range(10)) for o in g])

        def streamed(seed):
            s = client.chat.completions.create(model=model, messages=ASK, response_format=FORMAT, stream=True,
                                               temperature=1.0, seed=2000 + seed, max_tokens=a.max_tokens)
            text = "".join(ch.choices[0].delta.content or "" for ch in s if ch.choices)
            return text, check_json(text)

        report("json_schema, streamed", list(pool.map(streamed, range(20))))

        rx = r"[A-Z][a-z]{2,8} [0-9]{1,3}(, [A-Z][a-z]{2,8} [0-9]{1,3}){0,2}"

        def regex(seed):
            r = client.completions.create(model=model, prompt="Three cities and their sizes:", temperature=1.0,
                                          seed=seed, max_tokens=60, extra_body={"structured_outputs": {"regex": rx}})
            t = r.choices[0].text
            return t, None if re.fullmatch(rx, t) else "no match"

        report("regex (structured_outputs)", list(pool.map(regex, range(20))))
        choices = ["positive", "negative", "neutral"]

        def choice(seed):
            r = client.chat.completions.create(
                model=model, temperature=1.0, seed=seed, max_tokens=10,
                messages=[{"role": "user", "content": "Sentiment of: 'what a lovely day'"}],
                extra_body={"guided_choice": choices})
            t = r.choices[0].message.content
            return t, None if t in choices else "not a choice"

        report("choice (guided_choice)", list(pool.map(choice, range(20))))

    # Three turns, each answer constrained and fed back.
    msgs = list(ASK)
    turns = []
    for turn in range(3):
        r = client.chat.completions.create(model=model, messages=msgs, response_format=FORMAT,
                                           temperature=1.0, seed=3000 + turn, max_tokens=a.max_tokens)
        text = r.choices[0].message.content
        turns.append((text, check_json(text)))
        msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": "Another one, older."}]
    report("three turns, json_schema", turns)

    # A tool-use conversation: the model calls a tool, gets its answer, goes
    # on; required, then a named function, then auto.
    tools = [
        {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
         "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                        "required": ["city"], "additionalProperties": False}}},
        {"type": "function", "function": {"name": "get_time", "description": "The time in a timezone",
         "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 30}},
                        "required": ["timezone"], "additionalProperties": False}}},
    ]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    msgs = [{"role": "user", "content": "What is the weather in Paris and the time there?"}]
    calls_seen = []
    for turn, choice in enumerate(["required", {"type": "function", "function": {"name": "get_time"}}, "auto"]):
        # One call a turn, as an agent loop that answers each call in turn
        # asks (SmolLM2-135M, allowed several, lists calls to its budget).
        r = client.chat.completions.create(model=model, messages=msgs, tools=tools, tool_choice=choice,
                                           parallel_tool_calls=False, temperature=1.0, seed=4000 + turn,
                                           max_tokens=200)
        c = r.choices[0]
        calls = c.message.tool_calls or []
        for call in calls:
            try:
                jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
                calls_seen.append((call.function.arguments, None))
            except Exception as e:  # noqa: BLE001
                calls_seen.append((call.function.arguments, f"{type(e).__name__}: {e}"))
        if choice != "auto" and (not calls or c.finish_reason != "tool_calls"):
            calls_seen.append((str(c.message), f"tool_choice {choice}: no call (finish {c.finish_reason})"))
        if calls:
            msgs.append({"role": "assistant", "content": c.message.content,
                         "tool_calls": [call.model_dump() for call in calls]})
            for call in calls:
                msgs.append({"role": "tool", "tool_call_id": call.id, "content": "18 degrees; 14:05"})
        else:
            msgs.append({"role": "assistant", "content": c.message.content or ""})
        print(f"  tools turn {turn + 1} ({choice if isinstance(choice, str) else 'named'}): "
              f"{[(x.function.name, x.function.arguments) for x in calls] or repr((c.message.content or '')[:80])}")
    report("tool calls over three turns (required, named, auto)", calls_seen)
    print("all outputs follow their constraints" if not failures else f"{len(failures)} broken outputs")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
