"""Client-side tools: the serving benchmark (`specserve bench`) and accuracy evals (`specserve eval gsm8k`).

Nothing here imports the engine: these talk HTTP to any SGLang-/OpenAI-compatible server.
"""
