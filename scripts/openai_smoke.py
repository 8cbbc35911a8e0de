#!/usr/bin/env python3
"""Asks a running pdkv server, through the `openai` client, the capital of France.

Usage: python3 scripts/openai_smoke.py [BASE_URL]   (default http://127.0.0.1:8000/v1)
Exits non-zero unless both the plain and the streamed answer name Paris.
"""
import sys

from openai import OpenAI

base = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000/v1"
client = OpenAI(base_url=base, api_key="unused")
model = client.models.list().data[0].id
messages = [{"role": "user", "content": "Name the capital city of France."}]
plain = client.chat.completions.create(model=model, messages=messages, max_tokens=32, temperature=0)
text = plain.choices[0].message.content
stream = client.chat.completions.create(model=model, messages=messages, max_tokens=32, temperature=0, stream=True)
streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
print(f"plain:    {text!r} ({plain.usage.prompt_tokens} prompt, {plain.usage.completion_tokens} completion tokens)")
print(f"streamed: {streamed!r}")
sys.exit(0 if "Paris" in text and "Paris" in streamed else 1)
