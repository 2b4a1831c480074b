"""What one HTTP request may ask of the server, and the server of its clients.

Each limit is a `ringllm serve` flag with a default that no ordinary client meets; going
past one is a 400 that names the field, the value and the limit (or a 413 / 415 / 503 where
the HTTP status says it better). The README's "Limits and safety" section lists them.

    per request        --max-choices          prompts x n (a completions list of prompts counts each)
                       --max-request-tokens   choices x max_tokens, an absent max_tokens
                                              counted as the whole context
                       --max-stop             stop strings; --max-stop-chars each
                       --max-stop-token-ids   stop_token_ids entries
                       --max-logit-bias       logit_bias entries
                       --max-messages         chat messages; --max-content-parts, over all of them
                       --max-tools            a chat request's tools (OpenAI's limit, 128: each
                                              schema's check costs milliseconds of Python)
                       --max-body-bytes       the body (413)
    per server         --max-stored-responses, --max-stored-response-bytes   the Responses
                                                API's store: least recently used out first
                       --max-concurrent-requests   requests being served at once (503, Retry-After);
                                                   a request counts once its body is read
                       --body-read-timeout-s       how long a client may take to send its body (408)
                       --stream-write-timeout-s    a client that reads no byte of its stream
                                                   this long is dropped, its request aborted
                       --max-queued-outputs        outputs waiting for a slow stream (dropped past it)
                       --max-queued-output-bytes   their bytes, one request's (dropped past it)
                       --max-queued-output-bytes-total   every request's together (past it,
                                                   the one whose client read nothing the
                                                   longest is dropped)
                       --request-ring-wait-s       how long a request waits for room on a full
                                                   request ring before a 503 with Retry-After
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass(frozen=True)
class ServerLimits:
    max_choices: int = dataclasses.field(
        default=256, metadata=_help("most choices (prompts x n) in one request")
    )
    max_request_tokens: int = dataclasses.field(
        default=1 << 21,
        metadata=_help(
            "most output tokens one request may ask for: choices x max_tokens, an absent "
            "max_tokens counted as the whole context"
        ),
    )
    max_stop: int = dataclasses.field(default=16, metadata=_help("most stop strings a request"))
    max_stop_chars: int = dataclasses.field(
        default=512, metadata=_help("longest stop string, in characters")
    )
    max_stop_token_ids: int = dataclasses.field(
        default=256, metadata=_help("most stop_token_ids a request")
    )
    max_logit_bias: int = dataclasses.field(
        default=1024, metadata=_help("most logit_bias entries a request")
    )
    max_messages: int = dataclasses.field(
        default=2048, metadata=_help("most messages in one chat request")
    )
    max_content_parts: int = dataclasses.field(
        default=4096, metadata=_help("most content parts over all messages of a chat request")
    )
    max_tools: int = dataclasses.field(
        default=128,
        metadata=_help(
            "most tools in one chat request (OpenAI's limit; each tool's schema is checked "
            "in milliseconds of Python)"
        ),
    )
    max_concurrent_requests: int = dataclasses.field(
        default=1024,
        metadata=_help(
            "requests served at once (each counted once its body is read); more wait for none: 503"
        ),
    )
    body_read_timeout_s: float = dataclasses.field(
        default=60.0,
        metadata=_help(
            "a client that has not sent its whole request body this long after its headers "
            "gets 408 and its connection is closed"
        ),
    )
    stream_write_timeout_s: float = dataclasses.field(
        default=30.0,
        metadata=_help("a streaming client that takes no byte for this long is dropped"),
    )
    max_queued_outputs: int = dataclasses.field(
        default=4096,
        metadata=_help("outputs one request may have waiting for its client; past it: dropped"),
    )
    max_queued_output_bytes: int = dataclasses.field(
        default=4 << 20,
        metadata=_help(
            "bytes of outputs one request may have waiting for its client; past it: dropped"
        ),
    )
    max_queued_output_bytes_total: int = dataclasses.field(
        default=256 << 20,
        metadata=_help(
            "bytes of outputs all requests together may have waiting for their clients; past "
            "it the request whose client has read nothing the longest is dropped"
        ),
    )
    request_ring_wait_s: float = dataclasses.field(
        default=5.0,
        metadata=_help("how long a request waits for room on a full request ring (then 503)"),
    )

    max_stored_responses: int = dataclasses.field(
        default=1000,
        metadata=_help(
            "Responses API responses kept for previous_response_id and GET (least recently "
            "used out first)"
        ),
    )
    max_stored_response_bytes: int = dataclasses.field(
        default=256 << 20,
        metadata=_help("bytes (their JSON) the stored Responses API responses may hold"),
    )

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not value > 0:
                raise ValueError(f"{f.name}: must be > 0, got {value!r}")


def add_limit_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("limits (docs/reliability.md, 'Limits and safety')")
    for f in dataclasses.fields(ServerLimits):
        kind = float if isinstance(f.default, float) else int
        group.add_argument(
            "--" + f.name.replace("_", "-"),
            type=kind,
            default=f.default,
            help=f"{f.metadata['help']} (default {f.default})",
        )


def limits_from_args(args: argparse.Namespace) -> ServerLimits:
    return ServerLimits(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ServerLimits)})
