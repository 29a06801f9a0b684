"""The engine's interface served by an OpenAI-compatible server (vLLM, SGLang, llama.cpp's server, Ollama):
``client`` (HTTP and server-sent events, standard library only), ``messages`` (the conversation and request
body as the server takes them), ``engine`` (``RemoteEngine``: the events, sessions and cancellation the node
and the CLI use)."""
