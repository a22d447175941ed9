"""The OpenAI-compatible endpoint of agent-program rollouts (rollout/openai_server.py, rollout/openai_episodes.py),
called with the real `openai` client against the hf engine on a tiny model:

- the recorded tokens are the engine's: the prompt ids are the chat template's rendering of the messages (with
  the tools) tokenised independently here, the completion ids and log-probs what the engine generates for that
  prompt with the same seed, and the log-probs those of a teacher-forced transformers forward;
- concurrent calls are batched into fewer engine calls than requests;
- an episode whose history re-renders as the engine saw it becomes one sample with the loss mask on the
  completions only; a template that renders past assistant turns differently is a mismatch, not trained on;
- OpenAI-style 4xx errors, and 503 outside a rollout (after the bounded wait), a wait that a rollout ends;
- tool calls in the model's text become `tool_calls`, and a tool-call round trip through the client, rendered by
  the shipped character template, is one trainable episode; n, stop and max_tokens are honoured.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import threading
import time

import pytest
import torch

openai = pytest.importorskip("openai", reason="the endpoint's tests call it with the openai client: "
                                              "pip install -e '.[dev]'")

from megatron_rl.config.schema import ModelConfig  # noqa: E402
from megatron_rl.data.tokenizer import load_tokenizer  # noqa: E402
from megatron_rl.models.hf import build_hf_model, hub_state_dict  # noqa: E402
from megatron_rl.rollout.base import SamplingParams  # noqa: E402
from megatron_rl.rollout.hf_engine import HFEngine  # noqa: E402
from megatron_rl.rollout.openai_episodes import build_episode  # noqa: E402
from megatron_rl.rollout.openai_server import OpenAIServer, ServeSettings, parse_tool_calls  # noqa: E402

# Qwen-like, with tools and tool calls, for the character tokenizer.
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>\n"
    "{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{%- if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# The same, but past assistant turns are rendered under another role name: the history the agent sends back no
# longer reads as the tokens the engine produced.
REWRITING_TEMPLATE = TOOLS_TEMPLATE.replace("<|im_start|>{{ m.role }}",
                                            "<|im_start|>{{ 'bot' if m.role == 'assistant' else m.role }}")
TOOLS = [{"type": "function", "function": {"name": "add", "description": "a + b",
                                           "parameters": {"type": "object", "properties": {}}}}]
SETTINGS = ServeSettings("policy", temperature=1.0, top_p=1.0, top_k=-1, max_tokens=12, max_context_tokens=400)


@pytest.fixture(scope="module")
def model_and_engine():
    # vocab 99 = the character tokenizer's ids: every generated id decodes to a character or a special token
    cfg = ModelConfig(num_layers=2, vocab_size=99)
    model = build_hf_model(cfg, seed=3).eval()
    tokenizer = load_tokenizer("builtin:char")
    tokenizer.chat_template = TOOLS_TEMPLATE
    engine = HFEngine(cfg, tokenizer=tokenizer)
    engine.update_weights(hub_state_dict(model).items(), version=7)
    return model, engine, tokenizer


@pytest.fixture(scope="module")
def server(model_and_engine):
    _, _, tokenizer = model_and_engine
    server = OpenAIServer(tokenizer, wait_s=0.3).start()
    yield server
    server.shutdown()


def _client(server, episode_id=None, **kw):
    headers = {"X-Episode-Id": episode_id} if episode_id else {}
    return openai.OpenAI(base_url=server.base_url, api_key="x", default_headers=headers, max_retries=0, **kw)


def _encode(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_recorded_tokens_are_the_engines_and_the_prompt_is_the_template_with_tools(model_and_engine, server):
    model, engine, tokenizer = model_and_engine
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 3 -> 5"}]
    server.register(["e1"])
    with server.serving(engine, SETTINGS):
        reply = _client(server, "e1").chat.completions.create(model="policy", messages=messages, tools=TOOLS,
                                                              max_tokens=10, seed=11, temperature=0.8)
        assert [m.id for m in _client(server).models.list()] == ["policy"]
    [call] = server.take("e1")
    want_prompt = _encode(tokenizer, tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False,
                                                                   add_generation_prompt=True))
    assert call.prompt_ids == want_prompt and "Tools: add" in tokenizer.decode(call.prompt_ids)
    # the engine itself, on the same prompt with the same seed and settings
    [gen] = engine.generate([want_prompt], SamplingParams(temperature=0.8, max_new_tokens=10, seed=11,
                                                          stop_token_ids=(2,)))
    [choice] = call.choices
    assert choice.output_ids == gen.output_ids and choice.logprobs == gen.logprobs
    assert choice.weight_version == 7
    ids = torch.tensor([want_prompt + choice.output_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(want_prompt) - 1:-1].float() / 0.8
    forward = torch.log_softmax(logits, -1).gather(-1, torch.tensor(choice.output_ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(choice.logprobs), forward, atol=1e-4)
    text = tokenizer.decode(choice.output_ids, skip_special_tokens=True)
    assert reply.choices[0].message.content == (text or None)
    assert reply.usage.prompt_tokens == len(want_prompt) and reply.usage.completion_tokens == len(gen.output_ids)


def test_concurrent_calls_are_batched_and_n_samples_each(model_and_engine, server):
    _, engine, _ = model_and_engine
    ids = [f"b{k}" for k in range(8)]
    server.register(ids)
    with server.serving(engine, SETTINGS):
        batcher = server._batcher

        def one(eid):
            return _client(server, eid).completions.create(model="policy", prompt=f"{eid}:", max_tokens=4, n=2,
                                                           user=eid)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            replies = list(pool.map(one, ids))
        batches = batcher.batches
    assert all(len(r.choices) == 2 for r in replies)
    assert batches < 16  # 8 requests of n=2: 16 sequences, fewer engine calls
    calls = [server.take(eid) for eid in ids]
    assert all(len(c) == 1 and len(c[0].choices) == 2 for c in calls)


def _two_turns(server, engine, eid, tokenizer, template):
    """An agent's episode: ask, answer the reply with a tool result, ask again (the history as the client sees it)."""
    tokenizer.chat_template = template
    try:
        server.register([eid])
        with server.serving(engine, SETTINGS):
            client = _client(server, eid)
            messages = [{"role": "user", "content": "2 3 -> 5"}]
            first = client.chat.completions.create(model="policy", messages=messages, max_tokens=8, seed=5)
            messages += [{"role": "assistant", "content": first.choices[0].message.content or ""},
                         {"role": "tool", "content": "5"}]
            client.chat.completions.create(model="policy", messages=messages, max_tokens=8, seed=6)
        return server.take(eid)
    finally:
        tokenizer.chat_template = TOOLS_TEMPLATE


def test_an_episode_is_its_recorded_tokens_with_the_loss_on_completions_only(model_and_engine, server):
    _, engine, tokenizer = model_and_engine
    calls = _two_turns(server, engine, "m1", tokenizer, TOOLS_TEMPLATE)
    first, second = calls
    # the seeds give a first reply that holds no special token the decoded text would lose (<|im_start|>, eos)
    assert not {0, 1} & set(first.choices[0].output_ids)
    closed = first.choices[0].output_ids[-1] == 2  # ended by its end-of-turn token, or cut by max_tokens
    episode = build_episode(0, calls, 1.0, 1.0)
    assert episode.status == "submitted" and episode.num_turns == 2 and episode.weight_version == 7
    c1, c2 = first.choices[0].output_ids, second.choices[0].output_ids
    observation = second.prompt_ids[len(first.prompt_ids) + len(c1):]
    assert tokenizer.decode(observation) == ("" if closed else "<|im_end|>") + \
        "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    assert episode.prompt_tokens == first.prompt_ids
    assert episode.output_ids == c1 + observation + c2
    assert episode.model_mask == [1] * len(c1) + [0] * len(observation) + [1] * len(c2)
    assert episode.logprobs == first.choices[0].logprobs + [0.0] * len(observation) + second.choices[0].logprobs
    sample = episode.sample({})
    assert sample.tokens.tolist() == second.prompt_ids + c2  # the last call's prompt + completion, unchanged
    assert sample.loss_mask.tolist() == [0.0] * (len(first.prompt_ids) - 1) + [float(m) for m in episode.model_mask]


def test_a_template_that_rewrites_the_history_is_a_mismatch_not_trained_on(model_and_engine, server, caplog):
    _, engine, tokenizer = model_and_engine
    calls = _two_turns(server, engine, "m2", tokenizer, REWRITING_TEMPLATE)
    with caplog.at_level("WARNING"):
        episode = build_episode(0, calls, 1.0, 1.0)
    assert episode.status == "mismatch" and not episode.scored
    assert "does not extend the tokens the engine saw" in caplog.text
    from megatron_rl.rollout.multiturn import episode_metrics

    assert episode_metrics([episode])["agent/mismatch"] == 1.0
    # another temperature than the trainer's log-probs assume: left out too
    assert build_episode(0, _two_turns(server, engine, "m3", tokenizer, TOOLS_TEMPLATE), 0.7, 1.0).status \
        == "sampling_mismatch"


def test_content_given_as_text_parts_is_rendered_as_the_text(model_and_engine, server):
    """The OpenAI API lets content be a list of parts; the model must read their text, not the list's repr (a
    `{{ content }}` template) nor nothing (Qwen3's template renders non-string content as '')."""
    _, engine, tokenizer = model_and_engine
    parts = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
             {"role": "user", "content": [{"type": "text", "text": "2 3"}, {"type": "text", "text": "-> 5"}]}]
    as_text = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 3\n-> 5"}]
    server.register(["p1"])
    with server.serving(engine, SETTINGS):
        _client(server, "p1").chat.completions.create(model="policy", messages=parts, max_tokens=3, seed=1)
        with pytest.raises(openai.BadRequestError, match="text-only"):
            _client(server, "p1").chat.completions.create(model="policy", max_tokens=3, messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}])
    [call] = server.take("p1")
    assert call.prompt_ids == _encode(tokenizer, tokenizer.apply_chat_template(as_text, tokenize=False,
                                                                               add_generation_prompt=True))


def test_bad_requests_get_openai_errors(model_and_engine, server):
    _, engine, tokenizer = model_and_engine
    server.register(["x1"])
    client = _client(server, "x1")
    ok = [{"role": "user", "content": "hi"}]
    with server.serving(engine, SETTINGS):
        cases = [
            (dict(model="gpt-4o", messages=ok), openai.NotFoundError, "model_not_found", "model"),
            (dict(model="policy", messages=[]), openai.BadRequestError, "invalid_value", "messages"),
            (dict(model="policy", messages=ok, n=0), openai.BadRequestError, "invalid_value", "n"),
            (dict(model="policy", messages=ok, max_tokens=13), openai.BadRequestError, "invalid_value", "max_tokens"),
            (dict(model="policy", messages=ok, temperature=3), openai.BadRequestError, "invalid_value",
             "temperature"),
            (dict(model="policy", messages=ok, presence_penalty=0.5), openai.BadRequestError,
             "unsupported_parameter", "presence_penalty"),
            (dict(model="policy", messages=ok, logprobs=True), openai.BadRequestError, "unsupported_parameter",
             "logprobs"),
        ]
        for kwargs, error, code, param in cases:
            with pytest.raises(error) as got:
                client.chat.completions.create(**kwargs)
            assert got.value.body["code"] == code and got.value.body["param"] == param, got.value.body
            assert set(got.value.body) == {"message", "type", "param", "code"}
        with pytest.raises(openai.BadRequestError) as got:  # no messages at all (the client requires them)
            client.post("/chat/completions", body={"model": "policy"}, cast_to=object)
        assert got.value.body["code"] == "missing_messages"
        with pytest.raises(openai.BadRequestError) as got:
            _client(server).chat.completions.create(model="policy", messages=ok)
        assert got.value.body["code"] == "missing_episode_id"
        with pytest.raises(openai.BadRequestError) as got:
            _client(server, "never-registered").chat.completions.create(model="policy", messages=ok)
        assert got.value.body["code"] == "unknown_episode_id"
        with pytest.raises(openai.BadRequestError) as got:
            client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x" * 395}])
        assert got.value.body["code"] == "context_length_exceeded"
        tokenizer.chat_template = REWRITING_TEMPLATE.replace("{%- if tools %}", "{%- if false %}")
        try:  # a template that ignores `tools` would drop them: refused, not served without them
            with pytest.raises(openai.BadRequestError) as got:
                client.chat.completions.create(model="policy", messages=ok, tools=TOOLS)
        finally:
            tokenizer.chat_template = TOOLS_TEMPLATE
        assert got.value.body["code"] == "tools_not_supported"
    assert server.take("x1") == []  # nothing refused was generated or recorded


def test_outside_a_rollout_a_call_waits_then_gets_503_or_is_served_when_one_opens(model_and_engine, server):
    _, engine, _ = model_and_engine
    server.register(["w1"])
    client = _client(server, "w1", timeout=30)
    start = time.monotonic()
    with pytest.raises(openai.InternalServerError) as got:
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
    waited = time.monotonic() - start
    assert got.value.status_code == 503 and got.value.body["code"] == "engine_not_serving"
    assert "not serving" in got.value.body["message"] and 0.3 <= waited < 5
    # a call that arrives before the rollout opens waits for it (within wait_s) and is served
    result = {}
    thread = threading.Thread(target=lambda: result.update(reply=client.completions.create(
        model="policy", prompt="hi", max_tokens=3)))
    thread.start()
    time.sleep(0.1)
    with server.serving(engine, SETTINGS):
        thread.join(timeout=60)
    assert len(result["reply"].choices) == 1 and len(server.take("w1")) == 1


def test_stop_strings_and_tool_calls():
    content, calls = parse_tool_calls('I add. <tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>',
                                      "e-0-0")
    assert content == "I add." and len(calls) == 1
    assert calls[0]["function"]["name"] == "add" and json.loads(calls[0]["function"]["arguments"]) == {"a": 2, "b": 3}
    # malformed JSON or an unclosed call stays text
    for text in ('<tool_call>{"name": add}</tool_call>', '<tool_call>{"name": "add"'):
        assert parse_tool_calls(text, "e") == (text, [])


def test_stop_strings_end_the_returned_text(model_and_engine, server):
    _, engine, tokenizer = model_and_engine
    server.register(["s1", "s2"])
    with server.serving(engine, SETTINGS):
        free = _client(server, "s1").completions.create(model="policy", prompt="ab", max_tokens=12, seed=2)
        text = free.choices[0].text
        stop = text[3:5]  # a piece of what it writes unstopped (same seed: the same tokens up to there)
        assert len(stop) == 2 and "\n" not in stop
        cut = _client(server, "s2").completions.create(model="policy", prompt="ab", max_tokens=12, seed=2, stop=stop)
    assert cut.choices[0].text == text[:text.index(stop)] and cut.choices[0].finish_reason == "stop"
    [call] = server.take("s2")  # the recorded tokens end with the token that completed the stop string
    assert tokenizer.decode(call.choices[0].output_ids).endswith(stop)
    server.take("s1")


def test_a_tool_call_round_trip_through_the_client_is_one_trainable_episode():
    """A model that writes the template's own tool-call format (a scripted policy here, the project's engine for
    known turns): the reply comes back as `tool_calls`, the agent answers it with a `tool` message, and the
    history the shipped character template renders from the client's messages extends the engine's tokens, so
    the episode is trained on: two model turns (mask 1) around the tool result (mask 0)."""
    from megatron_rl.rollout.scripted import ScriptedPolicy

    tokenizer = load_tokenizer("builtin:char")  # its shipped template renders tools and tool calls
    call_text = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    policy = ScriptedPolicy(tokenizer, ["I add." + call_text, "5"], end_of_turn="<|im_end|>")
    policy.weight_version = 3
    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
    server = OpenAIServer(tokenizer, wait_s=0.3).start()
    try:
        server.register(["t1"])
        with server.serving(policy, dataclasses.replace(SETTINGS, max_tokens=100)):
            client = _client(server, "t1")
            messages = [{"role": "user", "content": "2 3 -> ?"}]
            first = client.chat.completions.create(model="policy", messages=messages, tools=tools)
            message = first.choices[0].message
            assert first.choices[0].finish_reason == "tool_calls" and message.content == "I add."
            [call] = message.tool_calls
            assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 2, "b": 3}
            messages += [message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": call.id, "content": "5"}]
            second = client.chat.completions.create(model="policy", messages=messages, tools=tools)
            assert second.choices[0].message.content == "5" and second.choices[0].finish_reason == "stop"
        calls = server.take("t1")
    finally:
        server.shutdown()
    assert tokenizer.decode(calls[0].prompt_ids).startswith("<|im_start|>system\nTools: add(a,b)<|im_end|>\n")
    episode = build_episode(0, calls, 1.0, 1.0)
    assert episode.status == "submitted" and episode.turn_versions == [3, 3]
    c1, c2 = calls[0].choices[0].output_ids, calls[1].choices[0].output_ids
    assert tokenizer.decode(c1) == "I add." + call_text + "<|im_end|>"
    observation = episode.output_ids[len(c1):len(episode.output_ids) - len(c2)]
    assert tokenizer.decode(observation) == "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    assert episode.model_mask == [1] * len(c1) + [0] * len(observation) + [1] * len(c2)


def test_a_seeded_request_is_warned_about_once(caplog):
    """A fixed seed from the agent makes every episode of a group sample the same completion (no spread for the
    group's advantages): said at the first seeded request, once."""
    import logging

    server = OpenAIServer(load_tokenizer("builtin:char")).start()
    body = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    settings = ServeSettings(model="policy", temperature=1.0, top_p=1.0, top_k=-1, max_tokens=4,
                             max_context_tokens=64)
    caplog.set_level(logging.WARNING, logger="megatron_rl.rollout.openai_server")
    server._sampling(body, settings, 5, [], "chat")
    assert not [r for r in caplog.records if "seed" in r.getMessage()]
    for seed in (42, 43):
        server._sampling(dict(body, seed=seed), settings, 5, [], "chat")
    said = [r.getMessage() for r in caplog.records if "carries seed=" in r.getMessage()]
    server.shutdown()
    assert said and len(said) == 1 and "seed=42" in said[0] and "no spread" in said[0]
