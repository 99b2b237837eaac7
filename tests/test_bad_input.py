"""Bad input gets a clear error naming the problem, before any work; one bad prompt in a
lazy stream fails alone."""

import json
import shutil

import pytest
import torch

from contbatch import LLM, GenerationInterrupted, SamplingParams
from contbatch.config import resolve_device
from contbatch.engine.scheduler import Scheduler
from tests.conftest import TINY_VOCAB


@pytest.fixture(scope="module")
def llm(tiny_model_dirs):
    return LLM(tiny_model_dirs["llama"], dtype="float32", skip_tokenizer_init=True, max_model_len=64)


@pytest.fixture(scope="module")
def text_llm(smollm_dir):
    return LLM(smollm_dir, dtype="float32", max_model_len=64, max_num_seqs=4)


def test_empty_prompt_list_gives_no_outputs_as_in_vllm(llm):
    steps = llm.engine.stats.num_steps
    assert llm.generate([]) == [] and list(llm.iter_generate(())) == []
    with pytest.raises(ValueError, match="sampling_params"):  # still checked against the prompts
        llm.generate([], [SamplingParams()])
    assert llm.engine.stats.num_steps == steps


def test_a_misspelt_key_of_a_dict_prompt_is_refused(llm):
    with pytest.raises(ValueError, match=r"prompts\[1\]: unknown key\(s\) 'sampling_param' in a dict prompt; known: "
                                         r"'lora_request', 'prompt', 'prompt_token_ids', 'sampling_params'"):
        llm.generate([[5, 6], {"prompt_token_ids": [5, 6], "sampling_param": SamplingParams(max_tokens=1)}])


def test_empty_prompts_listed_by_index_before_any_work(text_llm):
    steps_before = text_llm.engine.stats.num_steps
    with pytest.raises(ValueError) as info:
        text_llm.generate(["fine", "", "also fine", ""], SamplingParams(max_tokens=2))
    message = str(info.value)
    assert "prompts[1]" in message and "prompts[3]" in message and "empty" in message
    assert "prompts[0]" not in message
    assert text_llm.engine.stats.num_steps == steps_before, "work started despite invalid input"


def test_prompt_longer_than_max_model_len(llm):
    with pytest.raises(ValueError, match=r"prompts\[1\].*max_model_len=64"):
        llm.generate([[5, 6], list(range(3, 70))])


def test_token_ids_outside_vocabulary(llm):
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[5, 100_000]])


def test_wrong_prompt_type(llm):
    with pytest.raises(ValueError, match="prompts\\[0\\].*str, a list of token ids or a dict"):
        llm.generate([3.5])


def test_text_prompt_without_tokenizer(llm):
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate(["hello"])


def test_sampling_params_count_mismatch(llm):
    with pytest.raises(ValueError, match="2 entries but there are 3 prompts"):
        llm.generate([[5], [6], [7]], [SamplingParams(), SamplingParams()])


def test_sampling_params_wrong_type(llm):
    with pytest.raises(TypeError, match="sampling_params"):
        llm.generate([[5]], {"temperature": 0})


def test_bad_prompt_in_lazy_stream_fails_alone(llm):
    prompts = iter([[5, 6, 7], [], list(range(3, 80)), [8, 9]])
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert [o.error is None for o in outputs] == [True, False, False, True]
    assert "no tokens" in outputs[1].error and "max_model_len" in outputs[2].error
    assert len(outputs[0].outputs[0].token_ids) == 3 and len(outputs[3].outputs[0].token_ids) == 3


def _out_of_range_seed() -> SamplingParams:
    """Params whose seed was set past torch's range after construction (construction refuses it)."""
    params = SamplingParams(temperature=0.8, max_tokens=3, seed=1)
    params.seed = 2**70
    return params


def test_out_of_range_seed_in_a_list_is_refused_before_any_work(llm):
    steps_before = llm.engine.stats.num_steps
    with pytest.raises(ValueError, match=r"sampling_params\[1\]: SamplingParams\.seed .*2\*\*64 - 1"):
        llm.generate([[5, 6], [7, 8]], [SamplingParams(max_tokens=3), _out_of_range_seed()], use_tqdm=False)
    prompts = [[5, 6], {"prompt_token_ids": [7, 8], "sampling_params": _out_of_range_seed()}]
    with pytest.raises(ValueError, match=r"prompts\[1\]: SamplingParams\.seed"):
        llm.generate(prompts, use_tqdm=False)
    assert llm.engine.stats.num_steps == steps_before, "work started despite invalid input"


def test_out_of_range_seed_in_a_lazy_stream_fails_alone(llm):
    prompts = iter([[5, 6], {"prompt_token_ids": [7, 8], "sampling_params": _out_of_range_seed()}, [9, 10]])
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert [o.error is None for o in outputs] == [True, False, True]
    assert "SamplingParams.seed" in outputs[1].error and "2**64 - 1" in outputs[1].error
    assert [len(outputs[i].outputs[0].token_ids) for i in (0, 2)] == [3, 3]


def test_out_of_range_seed_in_iter_generate(llm):
    with pytest.raises(ValueError, match=r"sampling_params\[0\]: SamplingParams\.seed"):
        llm.iter_generate([[5, 6]], [_out_of_range_seed()])  # a list: refused at the call, before iterating
    prompts = iter([[5, 6], {"prompt_token_ids": [7, 8], "sampling_params": _out_of_range_seed()}])
    outputs = {o.request_id: o for o in llm.iter_generate(prompts, SamplingParams(temperature=0, max_tokens=2))}
    assert outputs["0"].error is None and len(outputs["0"].outputs[0].token_ids) == 2
    assert "SamplingParams.seed" in outputs["1"].error


def test_stop_token_ids_outside_the_vocabulary_are_refused(llm):
    params = SamplingParams(max_tokens=3, min_tokens=2, stop_token_ids=[100_000])  # suppressed until 2 tokens
    with pytest.raises(ValueError, match=rf"SamplingParams\.stop_token_ids must be token ids in \[0, {TINY_VOCAB}\)"):
        llm.generate([[5, 6]], params, use_tqdm=False)


def test_the_largest_seed_runs_and_repeats(llm):
    params = SamplingParams(temperature=1.0, max_tokens=4, seed=2**64 - 1, n=2)
    first, again = (llm.generate([[5, 6, 7]], params, use_tqdm=False)[0] for _ in range(2))
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]


@pytest.mark.parametrize("lazy", [False, True])
def test_a_request_that_fails_as_it_starts_ends_alone(llm, monkeypatch, lazy):
    real = Scheduler.add_request

    def add_request(self, request_id, prompt, prompt_token_ids, params, *rest):
        if params.seed == 13:
            raise RuntimeError("no generator for 13")
        return real(self, request_id, prompt, prompt_token_ids, params, *rest)

    monkeypatch.setattr(Scheduler, "add_request", add_request)
    prompts = [[5, 6], [7, 8], [9, 10]]
    params = [SamplingParams(temperature=0.8, max_tokens=3, seed=seed) for seed in (1, 13, 2)]
    outputs = llm.generate(iter(prompts) if lazy else prompts, params, use_tqdm=False)
    assert [o.error is None for o in outputs] == [True, False, True]
    assert "no generator for 13" in outputs[1].error
    assert [len(outputs[i].outputs[0].token_ids) for i in (0, 2)] == [3, 3]


def test_a_raising_generator_keeps_the_finished_outputs(llm):
    count = llm.engine.config.max_num_seqs + 8  # more than one admission round, so some finish first

    def prompts():
        for index in range(count):
            yield [5 + index % 100, 7]
        raise OSError("the input went away")

    with pytest.raises(GenerationInterrupted) as stopped:
        llm.generate(prompts(), SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    assert isinstance(stopped.value.__cause__, OSError) and "the input went away" in str(stopped.value)
    outputs = stopped.value.outputs
    assert outputs, "the finished outputs were dropped"
    positions = [int(o.request_id) for o in outputs]
    assert positions == sorted(set(positions)), "not in input order"
    for position, output in zip(positions, outputs):
        assert output.error is None and output.prompt_token_ids == [5 + position % 100, 7]
        assert len(output.outputs[0].token_ids) == 1


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(dtype="float16", device="cpu"), "float16 is refused on CPU"),
        (dict(dtype="int8"), "dtype must be one of"),
        (dict(device="tpu"), "device must be"),
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(block_size=-4), "block_size"),
        (dict(max_model_len=10_000), "max_position_embeddings"),
        (dict(kv_cache_memory=1000), "kv_cache_memory"),
        (dict(quantize_embeddings=True), r"quantize_embeddings=True applies only with quantization='int8'"),
        (dict(quantize_lm_head=False), r"quantize_lm_head=False applies only with quantization='int8'"),
        (dict(seed=2**70), r"seed must be in \[0, 2\*\*64 - 1\], got 1180591620717411303424$"),
        (dict(seed=-1), r"seed must be in \[0, 2\*\*64 - 1\], got -1$"),
        (dict(kv_cache_dtype="fp8"), "kv_cache_dtype must be one of 'auto', 'int8', got 'fp8'; vLLM's fp8"),
        (dict(kv_cache_dtype="bfloat16"), "kv_cache_dtype must be one of 'auto', 'int8', got 'bfloat16'$"),
    ],
)
def test_bad_engine_arguments(tiny_model_dirs, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(tiny_model_dirs["llama"], skip_tokenizer_init=True, **kwargs)


def test_int8_on_a_machine_with_a_gpu_runs_on_the_cpu_unless_cuda_is_asked_for(tiny_model_dirs, monkeypatch):
    """int8 kernels are CPU only: on a GPU machine "auto" must pick the CPU, not refuse (as
    it did on the first GPU machine the suite ran on), and an explicit "cuda" is refused."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == torch.device("cuda")
    assert resolve_device("auto", cpu_only="quantization='int8'") == torch.device("cpu")
    with pytest.raises(ValueError, match="quantization='int8' has CPU kernels only"):
        resolve_device("cuda", cpu_only="quantization='int8'")
    with pytest.raises(ValueError, match="kv_cache_dtype='int8' has CPU kernels only"):
        LLM(tiny_model_dirs["llama"], skip_tokenizer_init=True, kv_cache_dtype="int8", device="cuda")
    for kwargs in (dict(quantization="int8"), dict(kv_cache_dtype="int8")):
        llm = LLM(tiny_model_dirs["llama"], skip_tokenizer_init=True, dtype="float32", **kwargs)
        assert llm.engine.runner.device == torch.device("cpu")
        out = llm.generate([[5, 7, 9]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 3


def test_missing_model_directory(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(tmp_path / "nope")


def test_directory_without_config(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        LLM(tmp_path)


def test_malformed_config(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        LLM(tmp_path)


def test_config_missing_fields(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match="malformed"):
        LLM(tmp_path)


def test_unsupported_architecture_lists_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        LLM(tmp_path)


def test_missing_weights(tiny_model_dirs, tmp_path):
    shutil.copy(tiny_model_dirs["llama"] / "config.json", tmp_path / "config.json")
    with pytest.raises(ValueError, match="safetensors"):
        LLM(tmp_path, skip_tokenizer_init=True)


def test_truncated_checkpoint(tiny_model_dirs, tmp_path):
    from safetensors.torch import load_file, save_file

    source = tiny_model_dirs["llama"]
    shutil.copy(source / "config.json", tmp_path / "config.json")
    tensors = load_file(source / "model.safetensors")
    tensors.pop("model.layers.1.mlp.down_proj.weight")
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="missing 1 tensors"):
        LLM(tmp_path, skip_tokenizer_init=True)


def test_generate_while_a_stream_runs_is_refused_as_is(tiny_model_dirs):
    llm = LLM(tiny_model_dirs["llama"], skip_tokenizer_init=True, dtype="float32")
    stream = llm.iter_generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=3))
    next(stream)  # the stream is running now
    with pytest.raises(RuntimeError, match="already running"):  # not wrapped in GenerationInterrupted
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
    rest = list(stream)
    assert len(rest) == 1 and rest[0].error is None
    # Two iterators made before either ran: the second to start is refused, the first is unharmed.
    first = llm.iter_generate([[1, 2]], SamplingParams(max_tokens=2))
    second = llm.iter_generate([[3, 4]], SamplingParams(max_tokens=2))
    assert next(first).error is None
    with pytest.raises(RuntimeError, match="already running"):
        next(second)
    assert list(first) == []  # its one request had finished
    assert len(llm.generate([[1, 2]], SamplingParams(max_tokens=2), use_tqdm=False)) == 1


def test_a_kv_cache_larger_than_the_memory_available_is_refused_before_the_weights_load(tiny_model_dirs, monkeypatch):
    from contbatch.engine import llm_engine

    monkeypatch.setattr(llm_engine, "load_model", lambda *args, **kwargs: pytest.fail("the weights were loaded"))
    with pytest.raises(ValueError, match=r"kv_cache_memory=\d+ bytes is more than the \d+ bytes .* available"):
        LLM(tiny_model_dirs["llama"], skip_tokenizer_init=True, kv_cache_memory=1 << 50)
