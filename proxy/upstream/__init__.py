"""Upstream mode: the proxy in front of OpenAI-compatible servers (vLLM, SGLang, llama.cpp, killick itself).

    config.py   the replicas, the model-name map, routing, timeouts (flags or a TOML/JSON file)
    routing.py  which replica answers: session affinity by rendezvous hashing, load for new sessions (torch-free)
    wire.py     the normalised Conversation as a chat completions request; chunks back into output events
    pool.py     the app's core in upstream mode: routes, streams, retries before the first output, health checks
    app.py      create_upstream_app / build_upstream_app (`killick serve --upstream URL ...`)
    bench.py    `killick bench upstream`: recordings as concurrent sessions, affinity vs round-robin
"""
