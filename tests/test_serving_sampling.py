"""Sampling parameters through a real `perfx serve` and the official openai client: penalties, logit bias,
min_tokens, stop_token_ids, include_stop_str_in_output give the text the Python API gives for the same
parameters (a reference process with the server's kernels); parameters perfx does not implement are 400s."""

from __future__ import annotations

import pytest
from test_serving import client_and_model, run_reference, serve

openai = pytest.importorskip("openai")

PROMPT = "List the days of the week: Monday, Tuesday,"
CHAT = [{"role": "user", "content": "Say hi."}]
TOKENS = 24
REFERENCE = """
import json, sys
import perfx_core
m = perfx_core.load(None, context_length=512)
cases = json.loads(sys.argv[1])
out = {}
for name, (chat, kwargs) in cases.items():
    kwargs = dict(kwargs)
    if "logit_bias" in kwargs:
        kwargs["logit_bias"] = {int(k): v for k, v in kwargs["logit_bias"].items()}
    generation = m.chat(chat, **kwargs) if isinstance(chat, list) else m.generate(chat, **kwargs)
    text = generation.run()
    out[name] = [text, generation.stats.generated_tokens, generation.token_ids]
print(json.dumps(out))
"""


def _reference(cases):
    return run_reference(REFERENCE, cases)


@pytest.fixture(scope="module")
def server():
    yield from serve("--max-running", "4")


@pytest.fixture(scope="module")
def client(server):
    return client_and_model(server)


def test_sampling_parameters_give_the_python_apis_text(client):
    client, model = client
    greedy = _reference({"plain": (PROMPT, {"max_tokens": TOKENS, "temperature": 0})})["plain"]
    ids = greedy[2]
    first = ids[0]
    cut = next(i for i in range(3, len(ids)) if ids[i] not in ids[:i])  # a token new at position `cut`
    later = ids[cut]
    cases = {
        "frequency": (PROMPT, {"max_tokens": TOKENS, "temperature": 0, "frequency_penalty": 1.5}),
        "presence": (PROMPT, {"max_tokens": TOKENS, "temperature": 0, "presence_penalty": 2.0}),
        "bias": (PROMPT, {"max_tokens": TOKENS, "temperature": 0, "logit_bias": {str(first): -100}}),
        "stop_id": (PROMPT, {"max_tokens": TOKENS, "temperature": 0, "stop_token_ids": [later]}),
        "min_tokens": (CHAT, {"max_tokens": 40, "temperature": 0, "min_tokens": 30}),
        "eos": (CHAT, {"max_tokens": 40, "temperature": 0}),
        "include_stop": (PROMPT, {"max_tokens": TOKENS, "temperature": 0, "stop": [" Thursday"], "include_stop": True}),
    }
    ref = _reference(cases)
    # The parameters change the text (else this test could not fail).
    assert ref["frequency"][0] != greedy[0] and ref["presence"][0] != greedy[0] and ref["bias"][2][0] != first
    assert ref["stop_id"][2] == ids[:cut] and ref["eos"][1] < 30 <= ref["min_tokens"][1]
    assert ref["include_stop"][0].endswith(" Thursday")

    def complete(**kwargs):
        return client.completions.create(model=model, prompt=PROMPT, max_tokens=TOKENS, temperature=0, **kwargs)

    assert complete(frequency_penalty=1.5).choices[0].text == ref["frequency"][0]
    assert complete(presence_penalty=2.0).choices[0].text == ref["presence"][0]
    assert complete(logit_bias={str(first): -100}).choices[0].text == ref["bias"][0]
    stopped = complete(extra_body={"stop_token_ids": [later]}).choices[0]
    assert stopped.text == ref["stop_id"][0] and stopped.finish_reason == "stop"
    kept = complete(stop=[" Thursday"], extra_body={"include_stop_str_in_output": True}).choices[0]
    assert kept.text == ref["include_stop"][0]
    chat = client.chat.completions.create(
        model=model, messages=CHAT, max_tokens=40, temperature=0, extra_body={"min_tokens": 30}
    )
    assert chat.choices[0].message.content == ref["min_tokens"][0] and chat.usage.completion_tokens >= 30


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),
        ({"guided_json": {"type": "object"}}, "guided_json"),
        ({"logit_bias": {"not-an-id": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"min_tokens": 100}, "min_tokens"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ],
)
def test_unsupported_or_bad_parameters_are_400(client, extra, param):
    client, model = client
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model, messages=CHAT, max_tokens=4, extra_body=extra)
    assert caught.value.body["param"] == param
