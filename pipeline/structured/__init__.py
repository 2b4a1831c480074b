"""Structured outputs: what a request asks its output to follow (`params`: the spec of a JSON
Schema, regex, choice or grammar, checked and size-limited) and the grammar backend that
turns a spec into per-request token matchers and bitmasks (`grammar`: llguidance).

A leaf of the package: it imports nothing of ringllm, so the shared types
(`SamplingParams`), the engine core, the sampler and the server can all use it.
"""
