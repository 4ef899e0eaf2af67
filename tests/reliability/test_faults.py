"""Frames lost, repeated and reordered between the scheduler and the worker (a fault-injecting socket on both
sides, PAGODA_TEST_FAULTS): every request is still answered with exactly the tokens it gets without faults, and
the server keeps serving; constraints that travel once by hash survive the same losses."""

from __future__ import annotations

import concurrent.futures
import re
from pathlib import Path

import pytest

from pagoda.llm import LLM
from pagoda.shared.messages import SamplingParams, StructuredOutputs
from tests.reliability.harness import running_server, stream_completion

pytestmark = [pytest.mark.slow]

# both directions: plans and constraints (scheduler PUB), results and acknowledgements (worker PUSH)
FAULTS = "plan=drop:0.15,dup:0.1,hold:0.15,seed:1;result=drop:0.15,dup:0.1,hold:0.15,seed:2"
PROMPTS = ["The capital of France is", "Write a haiku about rain:", "1, 2, 3, 4,", "Once upon a time",
           "The best way to learn Python is", "Q: What is a paged KV cache?\nA:"]
MAX_TOKENS = 12
CHOICES = ["alpha", "beta", "gamma"]


@pytest.mark.timeout(900)
def test_lost_repeated_and_reordered_plans_and_results_heal(smollm2_dir: Path) -> None:
    offline = LLM(str(smollm2_dir), max_model_len=1024)
    expected = offline.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    [choice] = offline.generate(["Pick one:"], SamplingParams(
        temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputs(choice=CHOICES)))
    del offline
    with running_server(smollm2_dir, env={"PAGODA_TEST_FAULTS": FAULTS}) as server:
        bodies = [{"prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True} for p in PROMPTS]
        bodies += [{"prompt": "Pick one:", "max_tokens": 8, "temperature": 0, "structured_outputs": {"choice": CHOICES}}
                   for _ in range(2)]  # the second names the constraint by the hash the first sent
        with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
            outcomes = list(pool.map(lambda body: stream_completion(server, body, timeout=300), bodies))
        for outcome, want in zip(outcomes, [*expected, choice, choice], strict=True):
            assert outcome.status == 200 and outcome.error is None and outcome.done, outcome
            assert outcome.text == want.outputs[0].text, (outcome.text, want.outputs[0].text)
        assert outcomes[-1].text in CHOICES
        log = server.log()
        resent = len(re.findall(r"resending message", log))
        print(f"\nfaults: {resent} resends, {log.count('dropped a repeated')} repeats seen")
        assert resent > 0, "no frame was lost: the faults did not apply"
        assert server.healthy() and server.process.poll() is None
