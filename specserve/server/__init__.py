"""HTTP server: OpenAI-compatible and SGLang-native routes in front of an engine that runs in its own process.

Process layout (see launch.py): the HTTP process (FastAPI + uvicorn on asyncio) tokenises, applies chat templates,
detokenises incrementally and tracks requests (tokenizer_manager.py); the model process (model_process.py) owns
the EngineCore and runs the scheduler loop. They talk over two pipes (messages.py, engine_client.py).
"""
