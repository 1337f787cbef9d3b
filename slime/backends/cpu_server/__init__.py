"""slime's CPU inference server: a real LLM server (own batched model, KV cache, continuous batching, SGLang
sampling) speaking SGLang's HTTP API, so the whole RL loop runs on machines without a GPU.

    python -m slime.backends.cpu_server --model-path DIR --host 127.0.0.1 --port 30000
"""
