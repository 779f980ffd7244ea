"""`kvlab serve --kv-policy`: a real server whose chat outgrows the model's context and the pool, driven by
the official `openai` client; its replies equal the policy done by hand on the contiguous reference cache
(kvlab/verify/policy_reference.py), and the pool holds a bounded number of blocks throughout."""

from __future__ import annotations

import openai
import pytest

import kvlab
from kvlab.policies import AttentionSinks
from kvlab.verify.policy_reference import greedy_tokens
from serve_helpers import chat_server, clean_exit

POLICY = AttentionSinks(4, 60)
LINES = ["Now is the winter of our discontent made glorious summer by this sun of York;",
         "And all the clouds that lour'd upon our house in the deep bosom of the ocean buried.",
         "Friends, Romans, countrymen, lend me your ears; I come to bury Caesar, not to praise him."]


@pytest.fixture(scope="module")
def model_and_tokenizer():
    return kvlab.load(dtype="float64")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve-policy")
    # 8 blocks of 16 = 128 tokens, half the model's 256-token context; chunks of the policy's max_chunk,
    # as the policy by hand runs them (a policy's output depends on the chunks; a prefix hit
    # would move them, so prefix caching is off here: tests/test_engine_policy.py covers hits)
    proc = chat_server(tmp, "--kv-policy", str(POLICY), "--num-blocks", "8", "--block-size", "16",
                       "--max-num-batched-tokens", str(POLICY.max_chunk), "--no-enable-prefix-caching")
    yield proc
    assert clean_exit(proc.stop()), proc.log()


def test_a_chat_longer_than_the_context_equals_the_policy_by_hand(server, model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    messages = []
    for turn in range(4):  # each turn sends the whole conversation again, as chat clients do
        messages.append({"role": "user", "content": " ".join(LINES) + f" Turn {turn}."})
        reply = client.chat.completions.create(model=server_model(client), messages=messages, temperature=0,
                                               max_completion_tokens=12, extra_body={"ignore_eos": True})
        rendered = "<s>" + "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
        ids = tokenizer.encode(rendered, add_bos=False)
        assert reply.usage.prompt_tokens == len(ids)
        expected = greedy_tokens(model, POLICY, ids, 12)
        assert reply.choices[0].message.content == tokenizer.decode(expected)
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        state = server.wait_idle()
        assert state["num_used_blocks"] == 0 and state["num_blocks"] == 8
    assert len(ids) > model.config.max_position_embeddings  # the last turn outgrew the 256-token context
    assert server.metrics()["kvlab:generation_tokens_total"] == 4 * 12


def test_token_id_prompts_stream_the_same_tokens(server, model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    ids = tokenizer.encode(" ".join(LINES * 6), add_bos=False)
    assert len(ids) > model.config.max_position_embeddings
    stream = client.completions.create(model=server_model(client), prompt=ids, max_tokens=10, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    assert text == tokenizer.decode(greedy_tokens(model, POLICY, ids, 10))
    assert server.wait_idle()["num_used_blocks"] == 0


def server_model(client) -> str:
    return client.models.list().data[0].id
