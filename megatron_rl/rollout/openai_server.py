"""An OpenAI-compatible HTTP endpoint (`/v1/chat/completions`, `/v1/completions`, `/v1/models`) served from the
rollout engine while it holds the weights, recording per episode the exact tokens the engine saw and produced.

Black-box agents (any program written against the OpenAI API) call it; what trains is never their text but the
recorded calls: each call's prompt token ids (the chat template applied here, once), completion token ids and
the engine's log-probs (`Call`). `megatron_rl.rollout.openai_episodes` turns an episode's calls into a training
sample.

- An episode's calls are tied by its id: the `X-Episode-Id` header or the request's `user` field. Only ids
  registered for the current rollout are accepted (400 otherwise), so no call is generated and then lost.
- Requests from many agents (threads or processes) are batched into the engine's `generate` by the
  `BatchingEngine` front end of the async agent scheduler (requests with the same sampling settings meet in
  one call); `n` > 1 becomes n requests, batched together.
- The endpoint serves only inside `serving(engine)`: the rollout phase, between the engine's resume and
  release (colocated). A call outside it waits up to `wait_s` for the next rollout, then gets HTTP 503 with an
  OpenAI-style JSON error; calls in flight when it closes get 503 too.
- Bad requests get OpenAI-style 4xx JSON errors `{"error": {"message", "type", "param", "code"}}`.
- Tool calls: `tools` is passed to the chat template (which renders them as it was written to); the model's
  output is parsed for Hermes / Qwen calls `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` into
  `tool_calls` (finish_reason "tool_calls"); text that is not such a call stays `content`. Templates that
  format calls otherwise are not parsed. An assistant message's `tool_calls[].function.arguments` (a JSON
  string in the OpenAI API) is given to the template as a dict, as transformers' templates expect.

Written on the standard library's `ThreadingHTTPServer`: the API is a handful of JSON POST routes on a
loopback port inside the training job, one thread per connection is what blocking calls into the batching
front end need, and it adds no dependency to a job that runs on HPC nodes (no fastapi / uvicorn install).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import http.server
import json
import logging
import threading
import time
import uuid
from typing import Any, Iterator, Optional

from megatron_rl.rollout.base import SamplingParams

logger = logging.getLogger(__name__)

EPISODE_HEADER = "X-Episode-Id"
# Request fields that would change what is sampled or returned, and the values served (None: absent). Refused
# otherwise rather than ignored; fields that change nothing here (metadata, parallel_tool_calls, ...) pass.
UNSUPPORTED = {"presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0), "logit_bias": (None, {}),
               "response_format": (None, {"type": "text"}), "logprobs": (None, False), "top_logprobs": (None,),
               "tool_choice": (None, "auto"), "best_of": (None, 1), "echo": (None, False), "suffix": (None,),
               "stream_options": (None,), "top_k": (None,), "min_p": (None,), "repetition_penalty": (None,)}
_UNSERVED = None  # the place of a call that was not served (the rollout ended under it)


@dataclasses.dataclass
class Choice:
    """One sampled completion of a call, as the engine produced it."""

    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    weight_version: int


@dataclasses.dataclass
class Call:
    """One request of an episode: the prompt token ids the engine was given and its completions."""

    index: int  # arrival order within the episode
    prompt_ids: list[int]
    choices: list[Choice]
    temperature: float
    top_p: float
    route: str  # "chat" or "completions"


@dataclasses.dataclass(frozen=True)
class ServeSettings:
    """What one rollout serves with: the training sampling settings (the defaults of a request, and what the
    trainer's log-probs assume), its limits, and the served model's name."""

    model: str
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int  # a request's max_tokens at most (rollout.max_new_tokens)
    max_context_tokens: int  # prompt + max_tokens at most (task.max_episode_tokens)


class APIError(Exception):
    """An OpenAI-style error answer."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class OpenAIServer:
    """The endpoint: `start()` binds a port (0: any free one) on `host`; `serving(engine, settings)` opens it for
    one rollout; `register(ids)` before, `take(id)` after, for an episode's recorded calls."""

    def __init__(self, tokenizer: Any, host: str = "127.0.0.1", port: int = 0, wait_s: float = 30.0,
                 max_batch: int = 64) -> None:
        from megatron_rl.data.tasks import end_of_turn
        from megatron_rl.data.special_tokens import plain_text_prefix, stop_ids

        self.tokenizer, self.wait_s, self.max_batch = tokenizer, wait_s, max_batch
        eot = end_of_turn(tokenizer) if getattr(tokenizer, "chat_template", None) else ""
        ids = self._encode(eot) if eot else []
        # the checkpoint's other end-of-sequence ids end any reply (`end_of_sequence_ids`), and a chat reply also
        # the template's end-of-turn token
        self.end_ids = stop_ids(tokenizer, [])
        self.plain_prefix = plain_text_prefix(tokenizer)
        self.chat_stop_ids = stop_ids(tokenizer, ids)
        self._said_seed = False  # the warning about seeded requests is given once
        self._cond = threading.Condition()
        self._batcher: Any = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._settings: Optional[ServeSettings] = None
        self._episodes: dict[str, list[Call]] = {}
        self._httpd = http.server.ThreadingHTTPServer((host, port), _handler(self))
        self._httpd.daemon_threads = True
        self._thread: Optional[threading.Thread] = None

    @property
    def base_url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}/v1"

    def start(self) -> "OpenAIServer":
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="openai-server", daemon=True)
        self._thread.start()
        return self

    def shutdown(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    # -- the rollout's side --------------------------------------------------------------------------------
    @contextlib.contextmanager
    def serving(self, engine: Any, settings: ServeSettings) -> Iterator["OpenAIServer"]:
        """Serve from `engine` (which holds its weights) until the block ends; then stop: queued requests and the
        call in flight are cancelled (503) and the engine is idle again when this returns."""
        from megatron_rl.rollout.scheduler import BatchingEngine

        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="openai-server-loop", daemon=True)
        thread.start()
        batcher = BatchingEngine(engine, loop, max_batch=self.max_batch)
        with self._cond:
            self._batcher, self._loop, self._settings = batcher, loop, settings
            self._cond.notify_all()
        try:
            yield self
        finally:
            with self._cond:
                self._batcher = self._loop = self._settings = None
            batcher.close()
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=10)

    def register(self, episode_ids: list[str]) -> None:
        with self._cond:
            for eid in episode_ids:
                self._episodes[eid] = []

    def take(self, episode_id: str) -> list[Call]:
        """An episode's calls in arrival order; the id is no longer accepted afterwards."""
        with self._cond:
            return [c for c in self._episodes.pop(episode_id) if c is not _UNSERVED]

    # -- requests ----------------------------------------------------------------------------------------
    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _open(self) -> tuple[Any, asyncio.AbstractEventLoop, ServeSettings]:
        """The batching front end, waiting up to wait_s for a rollout to open it; 503 after."""
        give_up = time.monotonic() + self.wait_s
        with self._cond:
            while self._batcher is None:
                left = give_up - time.monotonic()
                if left <= 0:
                    raise APIError(503, f"the rollout engine is not serving (no rollout in progress; waited "
                                        f"{self.wait_s:g} s): the endpoint serves only while the engine holds the "
                                        "weights, between the engine's resume and release",
                                   "service_unavailable", code="engine_not_serving")
                self._cond.wait(left)
            return self._batcher, self._loop, self._settings

    def handle(self, route: str, body: Any, episode_header: Optional[str]) -> dict:
        """One POST to /v1/`route`: the OpenAI response object, or APIError."""
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        if body.get("stream"):
            raise APIError(400, "stream=true is not supported: ask for the whole response", param="stream",
                           code="unsupported_parameter")
        for key, allowed in UNSUPPORTED.items():
            if body.get(key) not in allowed:
                raise APIError(400, f"{key}={body[key]!r} is not supported by this endpoint (it serves "
                                    f"{' or '.join(repr(a) for a in allowed if a is not None) or 'nothing'} "
                                    "only): leave it out", param=key, code="unsupported_parameter")
        episode_id = episode_header or body.get("user")
        if not episode_id or not isinstance(episode_id, str):
            raise APIError(400, f"no episode id: send the episode id you were given in the {EPISODE_HEADER} header "
                                "or the `user` field", param="user", code="missing_episode_id")
        n = body.get("n", 1)
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise APIError(400, f"n={n!r} must be an integer >= 1", param="n", code="invalid_value")
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
            raise APIError(400, f"stop={body.get('stop')!r} must be a non-empty string or a list of at most 4",
                           param="stop", code="invalid_value")
        prompt_ids = self._chat_prompt(body) if route == "chat" else self._completion_prompt(body)
        batcher, loop, settings = self._open()
        if body.get("model") != settings.model:
            raise APIError(404, f"the model {body.get('model')!r} does not exist: this endpoint serves "
                                f"{settings.model!r}", param="model", code="model_not_found")
        params = self._sampling(body, settings, len(prompt_ids), stop, route)
        with self._cond:
            calls = self._episodes.get(episode_id)
            if calls is None:
                raise APIError(400, f"unknown episode id {episode_id!r}: use the id this rollout gave your agent "
                                    f"(its episodes are registered before it starts)", param="user",
                               code="unknown_episode_id")
            index = len(calls)
            calls.append(_UNSERVED)  # its place in arrival order, filled when it returns
        # n requests (batched together): the front end hands each request one generation. A seed makes a call
        # reproducible when it is batched alone (a batch draws from its first request's seed).
        futures = [asyncio.run_coroutine_threadsafe(batcher.generate(prompt_ids, dataclasses.replace(
            params, seed=None if params.seed is None else params.seed + k)), loop) for k in range(n)]
        try:
            gens = [f.result() for f in futures]
        except Exception as exc:
            with self._cond:  # its place in the episode is given up: it was not served
                if episode_id in self._episodes:
                    self._episodes[episode_id][index] = _UNSERVED
            ended = self._batcher is not batcher  # closed between its admission and its turn (a closed front end)
            if ended or isinstance(exc, (concurrent.futures.CancelledError, asyncio.CancelledError)):
                raise APIError(503, "the rollout ended while this request was being generated; it was not "
                                    "served", "service_unavailable", code="engine_not_serving") from None
            raise
        call = Call(index, prompt_ids, [Choice(g.output_ids, g.logprobs, g.finish_reason, g.weight_version)
                                        for g in gens], params.temperature, params.top_p, route)
        with self._cond:
            if episode_id in self._episodes:
                self._episodes[episode_id][index] = call
        return self._response(route, call, settings, stop, episode_id)

    def _chat_prompt(self, body: dict) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise APIError(400, "messages must be a non-empty list of {role, content} objects", param="messages",
                           code="missing_messages" if messages is None else "invalid_value")
        for k, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise APIError(400, f"messages[{k}] must be an object with a `role` string", param="messages")
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise APIError(400, "tools must be a list of tool definitions", param="tools")
        if not getattr(self.tokenizer, "chat_template", None):
            raise APIError(400, "the served tokenizer has no chat template: use /v1/completions",
                           code="no_chat_template")
        if tools and not self._renders_tools():
            raise APIError(400, "the served tokenizer's chat template does not render `tools` (the model would "
                                "never see them): give a template that does, or describe the tools in a message",
                           param="tools", code="tools_not_supported")
        try:
            text = self.tokenizer.apply_chat_template([_for_template(m) for m in messages], tools=tools or None,
                                                      add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # the template's own refusal (a role it does not know, ...), said as it was
            raise APIError(400, f"the chat template cannot render these messages: {type(exc).__name__}: {exc}",
                           param="messages") from None
        return self._encode(text)

    def _renders_tools(self) -> bool:
        """Whether the chat template puts a tool's name into the prompt (one it ignores would drop `tools`)."""
        probe = [{"type": "function", "function": {"name": "megatron_rl_probe_tool",
                                                   "parameters": {"type": "object", "properties": {}}}}]
        try:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": "u"}], tools=probe,
                                                      add_generation_prompt=True, tokenize=False)
        except Exception:  # a template that fails on tools renders none
            return False
        return "megatron_rl_probe_tool" in text

    def _completion_prompt(self, body: dict) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, str) and prompt:  # as vLLM's completions: with the BOS the tokenizer adds itself
            return self._encode(self.plain_prefix + prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                       for t in prompt):
            return list(prompt)  # token ids, taken as they are
        raise APIError(400, "prompt must be a non-empty string or a list of token ids (one prompt per request)",
                       param="prompt", code="missing_prompt" if prompt is None else "invalid_value")

    def _sampling(self, body: dict, settings: ServeSettings, prompt_len: int, stop: list[str],
                  route: str) -> SamplingParams:
        temperature = body.get("temperature")
        temperature = settings.temperature if temperature is None else temperature
        if not isinstance(temperature, (int, float)) or not 0 <= temperature <= 2:
            raise APIError(400, f"temperature={temperature!r} must be a number in [0, 2]", param="temperature",
                           code="invalid_value")
        top_p = body.get("top_p")
        top_p = settings.top_p if top_p is None else top_p
        if not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
            raise APIError(400, f"top_p={top_p!r} must be in (0, 1]", param="top_p", code="invalid_value")
        room = settings.max_context_tokens - prompt_len
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if max_tokens is None:
            max_tokens = min(settings.max_tokens, room)
        elif not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise APIError(400, f"max_tokens={max_tokens!r} must be an integer >= 1", param="max_tokens",
                           code="invalid_value")
        elif max_tokens > settings.max_tokens:
            raise APIError(400, f"max_tokens={max_tokens} is beyond this endpoint's limit {settings.max_tokens} "
                                "(rollout.max_new_tokens)", param="max_tokens", code="invalid_value")
        if room < 1 or prompt_len + max_tokens > settings.max_context_tokens:
            raise APIError(400, f"the prompt ({prompt_len} tokens) and max_tokens={max(max_tokens, 1)} exceed the "
                                f"episode's context of {settings.max_context_tokens} tokens "
                                "(task.max_episode_tokens)", param="messages" if route == "chat" else "prompt",
                           code="context_length_exceeded")
        seed = body.get("seed")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise APIError(400, f"seed={seed!r} must be an integer", param="seed", code="invalid_value")
        if seed is not None and not self._said_seed:
            self._said_seed = True
            logger.warning("an agent's request carries seed=%d: the episodes of a group that send the same prompt "
                           "with the same seed get the same completion, so the group has no spread to learn from "
                           "(all advantages 0); leave the seed out of a training agent's calls", seed)
        return SamplingParams(temperature=float(temperature), top_p=float(top_p), top_k=settings.top_k,
                              max_new_tokens=max_tokens, stop=tuple(stop), seed=seed,
                              stop_token_ids=self.chat_stop_ids if route == "chat" else self.end_ids)

    def _response(self, route: str, call: Call, settings: ServeSettings, stop: list[str], episode_id: str) -> dict:
        choices = []
        for k, choice in enumerate(call.choices):
            text = self.tokenizer.decode(choice.output_ids, skip_special_tokens=True)
            finish = "length" if choice.finish_reason == "length" else "stop"
            for s in stop:  # OpenAI's text excludes the stop string (the recorded tokens keep it)
                if s in text:
                    text = text[:text.index(s)]
            if route == "completions":
                choices.append({"index": k, "text": text, "finish_reason": finish, "logprobs": None})
                continue
            content, tool_calls = parse_tool_calls(text, f"{episode_id}-{call.index}-{k}")
            message = {"role": "assistant", "content": content}
            if tool_calls:
                message["tool_calls"], finish = tool_calls, "tool_calls"
            choices.append({"index": k, "message": message, "finish_reason": finish, "logprobs": None})
        completion = sum(len(c.output_ids) for c in call.choices)
        return {"id": f"{'chatcmpl' if route == 'chat' else 'cmpl'}-{uuid.uuid4().hex}",
                "object": "chat.completion" if route == "chat" else "text_completion", "created": int(time.time()),
                "model": settings.model, "choices": choices,
                "usage": {"prompt_tokens": len(call.prompt_ids), "completion_tokens": completion,
                          "total_tokens": len(call.prompt_ids) + completion}}


def parse_tool_calls(text: str, id_prefix: str) -> tuple[Optional[str], list[dict]]:
    """(content, tool_calls) of an assistant reply: each complete `<tool_call>{"name", "arguments"}</tool_call>`
    with valid JSON becomes an OpenAI tool call (arguments as a JSON string); a malformed one stays in the
    content, where the agent sees it as text. Content is the text outside the parsed calls, None when empty."""
    import re

    calls, kept, last = [], [], 0
    for match in re.finditer(r"<tool_call>(.*?)</tool_call>", text, re.DOTALL):
        try:
            call = json.loads(match.group(1).strip())
        except json.JSONDecodeError:
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) \
                or not isinstance(call.get("arguments", {}), dict):
            continue
        kept.append(text[last:match.start()])
        last = match.end()
        calls.append({"id": f"call_{id_prefix}_{len(calls)}", "type": "function",
                      "function": {"name": call["name"], "arguments": json.dumps(call.get("arguments", {}))}})
    content = ("".join(kept) + text[last:]).strip() if calls else text
    return (content or None), calls


def _for_template(message: dict) -> dict:
    """An OpenAI message as chat templates take it: tool-call arguments as a dict (the API sends a JSON string),
    content None as "", content given as a list of text parts as their texts joined by newlines (as vLLM does for
    text-only templates). Templates are written for string content: given the list, Qwen3's renders an empty turn
    and a plain `{{ content }}` the list's Python repr, so the model would be trained on a prompt the agent never
    wrote. Parts other than text (images, audio) are refused: the served model reads text only."""
    out = dict(message)
    if out.get("content") is None:
        out["content"] = ""
    elif isinstance(out["content"], list):
        texts = []
        for part in out["content"]:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("text", "refusal") or not isinstance(part.get(kind), str):
                raise APIError(400, f"message content part {part!r} is not supported: this endpoint serves a "
                                    "text-only model; send text parts ({'type': 'text', 'text': ...}) or a string",
                               param="messages", code="unsupported_content")
            texts.append(part[kind])
        out["content"] = "\n".join(texts)
    if isinstance(out.get("tool_calls"), list):
        calls = []
        for call in out["tool_calls"]:
            call = dict(call)
            function = dict(call.get("function") or {})
            if isinstance(function.get("arguments"), str):
                try:
                    function["arguments"] = json.loads(function["arguments"])
                except json.JSONDecodeError:
                    raise APIError(400, f"tool call arguments {function['arguments']!r} are not valid JSON",
                                   param="messages") from None
            call["function"] = function
            calls.append(call)
        out["tool_calls"] = calls
    return out


def _handler(server: OpenAIServer) -> type:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: the openai client reuses its connections

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002  (the base class's name)
            logger.debug("openai endpoint: " + format, *args)

        def _send(self, status: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802  (http.server's name)
            if self.path.rstrip("/") == "/v1/models":
                settings = server._settings
                models = [] if settings is None else [{"id": settings.model, "object": "model", "created": 0,
                                                       "owned_by": "megatron-rl"}]
                return self._send(200, {"object": "list", "data": models})
            self._send(404, APIError(404, f"no route GET {self.path}", code="not_found").body())

        def do_POST(self) -> None:  # noqa: N802
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            route = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}.get(self.path.rstrip("/"))
            try:
                if route is None:
                    raise APIError(404, f"no route POST {self.path}: this endpoint serves /v1/chat/completions "
                                        "and /v1/completions", code="not_found")
                try:
                    body = json.loads(raw or b"null")
                except json.JSONDecodeError as err:
                    raise APIError(400, f"the request body is not JSON: {err}") from None
                self._send(200, server.handle(route, body, self.headers.get(EPISODE_HEADER)))
            except APIError as err:
                self._send(err.status, err.body())
            except Exception as exc:  # an engine failure: said to the agent, and logged here
                logger.exception("openai endpoint: %s failed", self.path)
                self._send(500, APIError(500, f"{type(exc).__name__}: {exc}", "server_error").body())
    return Handler
