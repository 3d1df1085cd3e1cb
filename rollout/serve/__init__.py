"""The engine as a service: OpenAI/vLLM-compatible generation and weight pushes from a trainer process.

    python scripts/serve.py                       # the embedded tiny model on 127.0.0.1:8000

``build_app(engine, config)`` gives the FastAPI app (the engine loop runs in its own thread, started by
the app's lifespan); ``serve(engine, config)`` runs it under uvicorn. The trainer's side is
``trainer_hooks.client.RolloutClient``.
"""
