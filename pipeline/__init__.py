"""ringllm.pipeline: configs, requests, scheduling, KV cache, model running, offline API."""
