"""lm-evaluation-harness against a real `perfx serve`, with no local tokenizer (its remote tokenizer backend uses
/tokenizer_info and /tokenize): a loglikelihood, a multiple-choice and a generate_until task of our own
(tests/data/lm_eval_tasks), whose per-document scores must equal those computed from the same model's logits.

lm-eval lives in its own virtualenv (it pins libraries of its own); PERFX_LM_EVAL_PYTHON names its interpreter.
CI makes it (.ci/run); elsewhere the test skips without it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from test_serving import SERVER_ENV, Server

LM_EVAL_PYTHON = os.environ.get("PERFX_LM_EVAL_PYTHON")
DATA = Path(__file__).parent / "data" / "lm_eval_tasks"
TASKS = {
    "perfx_ll": """
output_type: loglikelihood
doc_to_text: "{{context}}"
doc_to_target: "{{target}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""",
    "perfx_mc": """
output_type: multiple_choice
doc_to_text: "Question: {{question}}\\nAnswer:"
doc_to_choice: "{{choices}}"
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""",
    "perfx_gen": """
output_type: generate_until
doc_to_text: "{{question}}"
doc_to_target: "{{answer}}"
generation_kwargs:
  until: ["\\n", ".", ",", "!", "?"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
""",
}
# The reference: each (context, continuation) scored from the teacher-forced logits, as lm-eval defines it (the
# sum of the continuation tokens' logprobs, and whether each was the argmax), plus greedy generations.
REFERENCE = """
import json, sys
import numpy as np
import perfx_core
from perfx_core.logprobs import log_softmax
m = perfx_core.load(None, context_length=512)
pairs, prompts = json.loads(sys.argv[1])
scores = []
for context, continuation in pairs:
    ctx = m.tokenizer.encode(context, add_special=True)
    whole = m.tokenizer.encode(context + continuation, add_special=True)
    cont = whole[len(ctx):] if whole[:len(ctx)] == ctx else m.tokenizer.encode(continuation)
    ids = ctx + cont
    logp = log_softmax(m.logits(ids))
    rows = range(len(ctx) - 1, len(ids) - 1)
    greedy = all(int(np.argmax(logp[i])) == ids[i + 1] for i in rows)
    scores.append([sum(float(logp[i, ids[i + 1]]) for i in rows), greedy])
texts = [m.generate(p, max_tokens=8, temperature=0, stop=["\\n", ".", ",", "!", "?"]).run() for p in prompts]
print(json.dumps([scores, texts]))
"""


def _docs(name):
    return [json.loads(line) for line in (DATA / f"{name}.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def lm_eval_python():
    if not LM_EVAL_PYTHON:
        if os.environ.get("CI"):
            pytest.fail("CI must set PERFX_LM_EVAL_PYTHON (.ci/run makes lm-eval's virtualenv)")
        pytest.skip("set PERFX_LM_EVAL_PYTHON to a Python with lm-eval[api] installed")
    return LM_EVAL_PYTHON


def test_lm_eval_scores_equal_the_engines(lm_eval_python, tmp_path):
    for name, body in TASKS.items():
        data = (DATA / f"{name}.jsonl").resolve()
        header = (
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
        )
        (tmp_path / f"{name}.yaml").write_text(header + body)
    ll, mc, gen = _docs("perfx_ll"), _docs("perfx_mc"), _docs("perfx_gen")
    pairs = [(d["context"], d["target"]) for d in ll]
    pairs += [(f"Question: {d['question']}\nAnswer:", " " + c) for d in mc for c in d["choices"]]
    out = subprocess.run(
        [sys.executable, "-c", REFERENCE, json.dumps([pairs, [d["question"] for d in gen]])],
        env=SERVER_ENV,
        capture_output=True,
        text=True,
        check=True,
    )
    scores, generations = json.loads(out.stdout)

    server = Server("--max-running", "4").wait_ready()
    try:
        model_id = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("PERFX_")}
        env.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        model_args = (
            f"base_url={server.url}/v1/completions,model={model_id},tokenizer_backend=remote,"
            "num_concurrent=1,max_retries=1,tokenized_requests=True"
        )
        run = subprocess.run(
            [lm_eval_python, "-m", "lm_eval", "--model", "local-completions", "--model_args", model_args]
            + ["--tasks", ",".join(TASKS), "--include_path", str(tmp_path), "--batch_size", "4"]
            + ["--output_path", str(tmp_path / "out"), "--log_samples"],
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    finally:
        server.stop()

    samples = {name: _samples(tmp_path / "out", name) for name in TASKS}
    # The sample logs hold the responses as strings: (logprob, is_greedy) per request.
    got = [s["resps"][0][0] for s in samples["perfx_ll"]]
    for (logprob, greedy), ref in zip(got, scores[: len(ll)], strict=True):
        assert float(logprob) == pytest.approx(ref[0], abs=1e-4) and greedy == str(ref[1])
    mc_scores = iter(scores[len(ll) :])
    for sample, doc in zip(samples["perfx_mc"], mc, strict=True):
        for resp, _choice in zip(sample["resps"], doc["choices"], strict=True):
            assert float(resp[0][0]) == pytest.approx(next(mc_scores)[0], abs=1e-4)
    assert [s["resps"][0][0] for s in samples["perfx_gen"]] == generations


def _samples(out: Path, task: str) -> list[dict]:
    (path,) = out.rglob(f"samples_{task}_*.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return sorted(rows, key=lambda r: r["doc_id"])
