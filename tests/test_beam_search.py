"""LLM.beam_search against the same search run on HF transformers' own log-probabilities (a
full fp32 forward pass per beam and step, no KV cache): the same sequences in the same order,
cumulative log-probabilities within 1e-4, EOS-completed beams and the length penalty included.
The search itself is vLLM's (contbatch/beam_search.py says it in words); what is under test is
that running it on contbatch's engine, with batched steps and beams continuing from their
parents' kept K/V (shared blocks, copy-on-write; freed under pressure and recomputed), gives
the sequences the model's own distribution ranks best, computing one token a beam a step."""

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from contbatch import LLM, BeamSearchParams, LoRARequest, SamplingParams
from contbatch.engine.kv_cache import KVCacheSpec
from contbatch.models.loader import read_config
from tests.conftest import make_peft_adapter

PROMPTS = [[1, 17, 33, 250, 9, 71], [1, 400, 3, 3, 18], [1] + list(range(5, 40))]


def _hf_beam_search(model, prompt: list[int], params: BeamSearchParams, eos: set[int]) -> list[tuple[list[int], float]]:
    """(tokens, cumulative logprob) of the best beams, best first, from HF's forward passes."""

    def score(beam: tuple[list[int], float]) -> float:
        tokens, cumulative = beam
        return cumulative / max(len(tokens) - (tokens[-1] in eos), 1) ** params.length_penalty

    live, complete = [(list(prompt), 0.0)], []
    for _ in range(params.max_tokens):
        candidates = []
        for tokens, cumulative in live:
            with torch.inference_mode():
                logprobs = torch.log_softmax(model(torch.tensor([tokens])).logits[0, -1].float(), dim=-1)
            top = torch.topk(logprobs, 2 * params.beam_width)
            for token, logprob in zip(top.indices.tolist(), top.values.tolist()):
                extended = (tokens + [token], cumulative + logprob)
                (complete if token in eos and not params.ignore_eos else candidates).append(extended)
        live = sorted(candidates, key=score, reverse=True)[: params.beam_width]
        if not live:
            break
    return sorted(complete + live, key=score, reverse=True)[: params.beam_width]


@pytest.fixture(scope="module")
def hf_model(tiny_model_dirs):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dirs["llama"], dtype=torch.float32).eval()


def _expect_hf(outputs, hf_model, params: BeamSearchParams, eos: set[int]) -> None:
    for prompt, output in zip(PROMPTS, outputs):
        expected = _hf_beam_search(hf_model, prompt, params, eos)
        assert [seq.tokens for seq in output.sequences] == [tokens for tokens, _ in expected], prompt
        for seq, (_, cumulative) in zip(output.sequences, expected):
            assert seq.cum_logprob == pytest.approx(cumulative, abs=1e-4)
            assert len(seq.logprobs) == len(seq.tokens) - len(prompt)


@pytest.mark.parametrize("beam_width, length_penalty", [(2, 1.0), (3, 0.0), (4, 2.0)])
def test_the_best_beams_are_hfs(tiny_model_dirs, hf_model, beam_width, length_penalty):
    llm = LLM(tiny_model_dirs["llama"], skip_tokenizer_init=True, dtype="float32")
    params = BeamSearchParams(beam_width=beam_width, max_tokens=6, ignore_eos=True, length_penalty=length_penalty)
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
    _expect_hf(outputs, hf_model, params, set())
    assert all(seq.finish_reason == "length" and seq.text is None for o in outputs for seq in o.sequences)


def test_a_beam_ending_in_eos_is_complete_and_ranked_with_the_rest(tiny_model_dirs, hf_model, tmp_path):
    """The model's second choice after the first prompt is made its EOS token: that beam stops
    there ("stop"), is not extended, and competes at the end with its length less the EOS."""
    with torch.inference_mode():
        second = int(torch.topk(hf_model(torch.tensor([PROMPTS[0]])).logits[0, -1], 2).indices[1])
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dirs["llama"], model_dir)
    for name in ("config.json", "generation_config.json"):
        settings = json.loads((model_dir / name).read_text())
        settings["eos_token_id"] = second
        (model_dir / name).write_text(json.dumps(settings))
    llm = LLM(model_dir, skip_tokenizer_init=True, dtype="float32")
    params = BeamSearchParams(beam_width=3, max_tokens=5)
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
    _expect_hf(outputs, hf_model, params, {second})
    stopped = [seq for seq in outputs[0].sequences if seq.finish_reason == "stop"]
    assert stopped and all(seq.tokens[-1] == second for seq in stopped), "the EOS beam did not survive: a weak test"


def test_each_step_computes_one_token_a_beam_and_frees_every_block_it_kept(tiny_model_dirs, hf_model):
    """After the prompts, a beam continues from its parent's kept K/V whatever the prefix cache
    holds (here none): 3 prompts x 3 beams, one token each, in each of the 5 steps after the
    first. Recomputing whole sequences (or their partial last blocks) would compute more."""
    llm = LLM(tiny_model_dirs["llama"], skip_tokenizer_init=True, dtype="float32", enable_prefix_caching=False)
    steps = []
    llm.engine.add_stats_listener(steps.append)
    params = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
    _expect_hf(outputs, hf_model, params, set())
    assert sum(step.num_scheduled_tokens for step in steps) == sum(map(len, PROMPTS)) + 5 * 3 * 3
    assert sum(step.num_copied_blocks for step in steps) > 0, "no beam shared its parent's partial block"
    assert llm.engine.block_manager.num_used_blocks == 0 and not llm.engine.scheduler.kept


def test_beams_whose_kept_blocks_do_not_fit_are_recomputed_to_the_same_result(tiny_model_dirs, hf_model):
    """A KV cache of 7 blocks cannot hold 3 x 4 beams (the third prompt's alone take 3 blocks
    each): kept blocks are freed, running beams preempted, and the beams recomputed."""
    model = tiny_model_dirs["llama"]
    spec = KVCacheSpec.for_model(read_config(model), 16, torch.float32)
    llm = LLM(model, skip_tokenizer_init=True, dtype="float32", kv_cache_memory=7 * spec.bytes_per_block,
              max_model_len=48)
    steps = []
    llm.engine.add_stats_listener(steps.append)
    params = BeamSearchParams(beam_width=4, max_tokens=6, ignore_eos=True)
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
    _expect_hf(outputs, hf_model, params, set())
    assert sum(step.num_scheduled_tokens for step in steps) > sum(map(len, PROMPTS)) + 5 * 3 * 4, "nothing recomputed"
    assert llm.engine.block_manager.num_used_blocks == 0 and not llm.engine.scheduler.kept
    again = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(again[0].outputs[0].token_ids) == 3, "the LLM does not run again after the search"


def test_beams_with_a_lora_adapter_are_the_adapted_models_best(tiny_model_dirs, tmp_path):
    """Each beam's continuation keeps its adapter: the best beams are those of PEFT's adapted model."""
    peft = pytest.importorskip("peft")
    model = tiny_model_dirs["llama"]
    adapter = make_peft_adapter(model, tmp_path / "adapter", 3, scale=4.0, r=8, target_modules=["q_proj", "down_proj"])
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    adapted = peft.PeftModel.from_pretrained(base, str(adapter)).eval()
    llm = LLM(model, skip_tokenizer_init=True, dtype="float32", enable_lora=True)
    params = BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True)
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params,
                              lora_request=LoRARequest("adapter", 1, str(adapter)))
    _expect_hf(outputs, adapted, params, set())
    plain = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert [o.sequences[0].tokens for o in plain] != [o.sequences[0].tokens for o in outputs], "a weak adapter"


def test_one_beam_is_greedy_decoding(smollm_dir):
    llm = LLM(smollm_dir, dtype="float32")
    prompts = ["The capital of France is", "def fibonacci(n):"]
    [first, other] = llm.beam_search(prompts, BeamSearchParams(beam_width=1, max_tokens=10))
    greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, logprobs=0), use_tqdm=False)
    for beams, output in zip((first, other), greedy):
        [seq] = beams.sequences
        assert seq.tokens == output.prompt_token_ids + output.outputs[0].token_ids
        assert seq.cum_logprob == pytest.approx(output.outputs[0].cumulative_logprob, abs=1e-4)
        assert seq.text == output.prompt + output.outputs[0].text  # vLLM's text: the prompt's too


def test_bad_input_is_refused_before_any_work(tiny_model_dirs):
    llm = LLM(tiny_model_dirs["llama"], skip_tokenizer_init=True, dtype="float32")
    with pytest.raises(ValueError, match="BeamSearchParams.beam_width must be an int >= 1, got 0"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="BeamSearchParams.beam_width must be at most 10 .*got 11"):
        BeamSearchParams(beam_width=11, max_tokens=4)
    with pytest.raises(ValueError, match="BeamSearchParams.length_penalty must be a finite number"):
        BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=float("nan"))
    with pytest.raises(TypeError, match="params must be a BeamSearchParams, got SamplingParams"):
        llm.beam_search([[1, 2]], SamplingParams())
    with pytest.raises(ValueError, match=r"1 invalid prompt\(s\), nothing was run: prompts\[1\]: prompt has no tokens"):
        llm.beam_search([[1, 2], []], BeamSearchParams(beam_width=2, max_tokens=4))
    assert llm.engine.stats.num_steps == 0


def test_beams_that_fill_the_context_end_there(tiny_model_dirs):
    llm = LLM(tiny_model_dirs["llama"], skip_tokenizer_init=True, dtype="float32", max_model_len=16)
    [output] = llm.beam_search([list(range(1, 11))], BeamSearchParams(beam_width=3, max_tokens=20, ignore_eos=True))
    assert [(len(seq.tokens), seq.finish_reason) for seq in output.sequences] == [(16, "length")] * 3


def test_the_score_leaves_a_final_eos_out_of_the_length():
    """HF's and vLLM's rule: summed logprob / (length without a final EOS) ** length_penalty."""
    from contbatch.beam_search import BeamSearch, BeamSearchSequence

    search = BeamSearch(BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=2.0), frozenset({9}), 64)
    assert search.score(BeamSearchSequence([1, 2, 9], cum_logprob=-8.0)) == -2.0  # -8 / 2**2
    assert search.score(BeamSearchSequence([1, 2, 3, 4], cum_logprob=-8.0)) == -0.5  # -8 / 4**2
