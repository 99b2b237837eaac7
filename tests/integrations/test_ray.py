"""contbatch on Ray Data, on a local two-CPU Ray cluster: two actors of one torch thread each
give the same completions as one LLM.generate, row for row; several batches feed each
actor's engine at once; an actor killed mid-run is restarted and every row still comes out
once; Parquet goes in and out; a bad row gets an error and the others run on."""

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import torch  # noqa: E402

from contbatch import LLM, SamplingParams  # noqa: E402
from contbatch.integrations.ray import COMPLETION_SCHEMA, build_processor  # noqa: E402

ENGINE_KWARGS = {"dtype": "float32", "kv_cache_memory": 64 << 20}
GREEDY = SamplingParams(temperature=0, max_tokens=12)
BATCH_SIZE = 4
TIMEOUT_S = 120


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray instance with 2 CPUs, no dashboard and no usage stats, shut down after. The
    two actors reserve half a CPU each: Ray Data's read and write tasks need the rest."""
    saved = os.environ.get("RAY_USAGE_STATS_ENABLED")
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    ray.init(num_cpus=2, include_dashboard=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield
    ray.shutdown()
    if saved is None:
        os.environ.pop("RAY_USAGE_STATS_ENABLED")
    else:
        os.environ["RAY_USAGE_STATS_ENABLED"] = saved


@pytest.fixture(scope="module")
def reference_llm(chat_model_dir):
    """One LLM, one torch thread like each actor: the same arithmetic, so the same greedy tokens."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield LLM(chat_model_dir, **ENGINE_KWARGS)
    torch.set_num_threads(threads)


def _rows(count: int) -> list[dict]:
    """Text prompts of varied lengths and, every third row, a chat conversation instead."""
    rows = []
    for i in range(count):
        words = " ".join(f"word{j}" for j in range(i % 7 + 1))
        if i % 3 == 2:
            rows.append({"id": i, "messages": [{"role": "user", "content": f"Say {words}"}]})
        else:
            rows.append({"id": i, "prompt": f"Row {i}: {words}"})
    return rows


def _reference(llm: LLM, rows: list[dict], params: SamplingParams = GREEDY) -> dict[int, list[int]]:
    """id -> greedy token ids from one generate() over the text rows and one chat() over the others."""
    text = [row for row in rows if "prompt" in row]
    chat = [row for row in rows if "messages" in row]
    outputs = llm.generate([row["prompt"] for row in text], params, use_tqdm=False)
    if chat:
        outputs += llm.chat([row["messages"] for row in chat], params, use_tqdm=False)
    return {row["id"]: output.outputs[0].token_ids for row, output in zip(text + chat, outputs)}


def _by_id(rows: list[dict]) -> dict[int, dict]:
    ids = [row["id"] for row in rows]
    assert len(ids) == len(set(ids)), f"rows output more than once: {sorted(i for i in ids if ids.count(i) > 1)}"
    return {row["id"]: row for row in rows}


def _step_recorder(directory: Path, step_delay_s: float = 0.0) -> Callable[[LLM], None]:
    """on_actor_start hook: each actor writes its pid, then one line per engine step (the
    sequences running in it) to directory/<pid>.steps; optionally slows every step down."""

    def on_actor_start(llm: LLM) -> None:
        log = open(directory / f"{os.getpid()}.steps", "a", buffering=1)

        def on_step(stats) -> None:
            log.write(f"{stats.num_running}\n")
            time.sleep(step_delay_s)

        llm.engine.add_stats_listener(on_step)

    return on_actor_start


def _steps(directory: Path) -> dict[int, list[int]]:
    """pid -> running sequences in each step that actor made."""
    return {int(path.stem): [int(line) for line in path.read_text().split()] for path in directory.glob("*.steps")}


def _processor(model_dir: Path, **kwargs):
    settings = dict(
        model=model_dir, sampling_params=GREEDY, engine_kwargs=ENGINE_KWARGS, concurrency=2,
        batch_size=BATCH_SIZE, max_concurrent_batches=4, num_cpus=0.5, num_threads=1,
    )
    return build_processor(**(settings | kwargs))


def test_two_actors_match_one_llm_row_for_row_with_batches_overlapping(
    ray_cluster, chat_model_dir, reference_llm, tmp_path, monkeypatch
):
    # Both actors up before the first batch: otherwise the first one ready can take all 32
    # rows while the second still loads its model (seen once in CI: one actor's pid only).
    monkeypatch.setattr(ray.data.DataContext.get_current(), "wait_for_min_actors_s", 600)
    rows = _rows(32)
    processor = _processor(chat_model_dir, on_actor_start=_step_recorder(tmp_path))
    out = _by_id(processor(ray.data.from_items(rows)).take_all())
    expected = _reference(reference_llm, rows)
    assert sorted(out) == sorted(expected)
    for row_id, tokens in expected.items():
        assert out[row_id]["error"] is None, out[row_id]["error"]
        assert out[row_id]["generated_token_ids"] == tokens, f"row {row_id}"
        assert out[row_id]["generated_text"] == reference_llm.get_tokenizer().decode(tokens, skip_special_tokens=True)
        assert out[row_id]["finish_reason"] in ("stop", "length")
    steps = _steps(tmp_path)
    assert len(steps) == 2, f"expected 2 actors, got pids {sorted(steps)}"
    # Batches of 4 rows: more than 4 running at once means several batches fed one engine.
    assert max(max(running, default=0) for running in steps.values()) > BATCH_SIZE, f"running per step: {steps}"


def test_actor_killed_mid_run_is_restarted_and_every_row_comes_out_once(
    ray_cluster, chat_model_dir, reference_llm, tmp_path
):
    rows = _rows(48)
    params = SamplingParams(temperature=0, max_tokens=16)
    # Slow steps keep the actors busy long enough to kill one while it runs requests.
    processor = _processor(
        chat_model_dir, sampling_params=params, max_concurrent_batches=2,
        on_actor_start=_step_recorder(tmp_path, step_delay_s=0.02),
    )
    killed: list[int] = []
    actors_at_kill: set[int] = set()

    def kill_an_actor_once_it_runs() -> None:
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:
            steps = _steps(tmp_path)
            busy = [pid for pid, running in steps.items() if len(running) >= 10]
            if len(steps) == 2 and busy:
                actors_at_kill.update(steps)
                os.kill(busy[0], signal.SIGKILL)
                killed.append(busy[0])
                return
            time.sleep(0.02)

    killer = threading.Thread(target=kill_an_actor_once_it_runs, daemon=True)
    killer.start()
    out, rows_before_kill = [], 0
    for row in processor(ray.data.from_items(rows)).iter_rows():
        out.append(row)
        rows_before_kill += not killed
    killer.join(TIMEOUT_S)
    assert killed, "no actor was killed: the run ended before an actor had made 10 steps"
    assert rows_before_kill < len(rows), "the actor was killed after every row had come out"
    steps = _steps(tmp_path)
    restarted = set(steps) - actors_at_kill
    assert len(restarted) == 1, f"expected the killed actor to be started again: actor pids {sorted(steps)}"
    assert steps[restarted.pop()], "the restarted actor ran no engine step: the killed actor's batches were not retried on it"
    by_id = _by_id(out)
    expected = _reference(reference_llm, rows, params)
    assert sorted(by_id) == sorted(expected)
    assert all(by_id[i]["generated_token_ids"] == tokens for i, tokens in expected.items())


def test_parquet_in_and_out_with_preprocess_and_postprocess(ray_cluster, chat_model_dir, reference_llm, tmp_path):
    questions = [f"What is {i} plus {i}?" for i in range(12)]
    pq.write_table(pa.table({"id": list(range(12)), "question": questions}), tmp_path / "in.parquet")

    def preprocess(row: dict) -> dict:
        max_tokens = 4 + row["id"] % 5
        return {"prompt": f"Q: {row['question']}\nA:", "sampling_params": {"temperature": 0, "max_tokens": max_tokens}}

    def postprocess(row: dict) -> dict:
        return {"id": row["id"], "answer_ids": row["generated_token_ids"], "error": row["error"]}

    processor = _processor(chat_model_dir, preprocess=preprocess, postprocess=postprocess)
    processor(ray.data.read_parquet(str(tmp_path / "in.parquet"))).write_parquet(str(tmp_path / "out"))
    table = pq.read_table(tmp_path / "out")
    assert set(table.column_names) == {"id", "answer_ids", "error"}
    out = _by_id(table.to_pylist())
    for i, question in enumerate(questions):
        params = SamplingParams(temperature=0, max_tokens=4 + i % 5)
        expected = reference_llm.generate([f"Q: {question}\nA:"], params, use_tqdm=False)[0].outputs[0].token_ids
        assert out[i]["answer_ids"] == expected and out[i]["error"] is None, f"row {i}"


def test_bad_rows_get_an_error_and_the_others_run_on_into_parquet(ray_cluster, chat_model_dir, reference_llm, tmp_path):
    good = _rows(9)
    bad = [
        {"id": 100, "prompt": "word " * 400},  # longer than the model's 256 positions
        {"id": 101, "prompt": "fine", "sampling_params": {"temperature": -1.0}},
        {"id": 102, "messages": [{"role": "user"}]},  # no content
        {"id": 103},  # nothing to generate from
    ]
    rows = good[:4] + bad + good[4:]
    _processor(chat_model_dir)(ray.data.from_items(rows)).write_parquet(str(tmp_path / "out"))
    table = pq.read_table(tmp_path / "out")
    for column in COMPLETION_SCHEMA:
        assert table.schema.field(column.name).type == column.type, column.name
    out = _by_id(table.to_pylist())
    assert "max_model_len" in out[100]["error"]
    assert "temperature" in out[101]["error"]
    assert "content" in out[102]["error"]
    assert "'prompt', 'prompt_token_ids' or 'messages'" in out[103]["error"]
    assert all(out[row["id"]]["generated_text"] is None for row in bad)
    expected = _reference(reference_llm, good)
    assert {i: out[i]["generated_token_ids"] for i in expected} == expected
    assert all(out[i]["error"] is None for i in expected)
    assert all(out[row["id"]].get("prompt") == row.get("prompt") for row in rows), "input columns were not kept"


def test_invalid_settings_are_refused_before_any_actor_starts(chat_model_dir):
    with pytest.raises(ValueError, match="max_num_sequences"):
        build_processor(model=chat_model_dir, engine_kwargs={"max_num_sequences": 4})
    with pytest.raises(ValueError, match="n must be 1"):
        build_processor(model=chat_model_dir, sampling_params=SamplingParams(n=2))
    with pytest.raises(ValueError, match="concurrency"):
        build_processor(model=chat_model_dir, concurrency=0)


def test_a_struct_column_of_overrides_merges_over_the_default_and_a_raising_preprocess_fails_its_row(
    ray_cluster, chat_model_dir, reference_llm
):
    """A "sampling_params" struct column has every field in every row, null where a row sets
    none: a row's nulls are left out and its fields override the processor's default (as bulk
    jobs merge them), so a row setting only max_tokens stays greedy and one setting only
    temperature keeps the default max_tokens. A preprocess that raises fails that row alone."""
    overrides = [{"max_tokens": 4, "temperature": None}, {"max_tokens": None, "temperature": 0.0}, None, None]
    table = pa.table({"id": [0, 1, 2, 3], "prompt": [f"Row {i}: word" for i in range(4)],
                      "sampling_params": pa.array(overrides, pa.struct([("max_tokens", pa.int64()),
                                                                        ("temperature", pa.float64())]))})

    def preprocess(row: dict) -> dict:
        if row["id"] == 3:
            raise KeyError("text")
        return row

    processor = _processor(chat_model_dir, concurrency=1, preprocess=preprocess)
    out = _by_id(processor(ray.data.from_arrow(table)).take_all())
    for i, params in ((0, SamplingParams(temperature=0, max_tokens=4)), (1, GREEDY), (2, GREEDY)):
        expected = reference_llm.generate([f"Row {i}: word"], params, use_tqdm=False)[0].outputs[0].token_ids
        assert out[i]["error"] is None and out[i]["generated_token_ids"] == expected, f"row {i}"
    assert out[3]["error"] == "preprocess raised KeyError: 'text'" and out[3]["generated_text"] is None


def test_without_sampling_params_rows_run_with_the_models_recommended_settings(
    ray_cluster, recommending_chat_model_dir
):
    """As LLM.generate and vLLM's generation_config="auto": the model's generation_config.json
    (2 new tokens here) is the default that rows' own overrides go over."""
    table = pa.table({"id": [0, 1], "prompt": ["Row 0: word", "Row 1: word"],
                      "sampling_params": pa.array([{"ignore_eos": True, "max_tokens": None},
                                                   {"ignore_eos": True, "max_tokens": 5}],
                                                  pa.struct([("ignore_eos", pa.bool_()), ("max_tokens", pa.int64())]))})
    processor = _processor(recommending_chat_model_dir, sampling_params=None, concurrency=1)
    out = _by_id(processor(ray.data.from_arrow(table)).take_all())
    assert [len(out[i]["generated_token_ids"]) for i in (0, 1)] == [2, 5], [out[i]["error"] for i in (0, 1)]


def test_a_lora_adapter_reaches_every_actor_and_gives_the_llms_rows(ray_cluster, chat_model_dir, tmp_path):
    """``lora_request``: two actors with the adapter give one LLM's adapter tokens, row for row,
    and not the base model's."""
    from contbatch import LoRARequest
    from tests.conftest import make_peft_adapter

    adapter = LoRARequest("a", 1, str(make_peft_adapter(chat_model_dir, tmp_path / "adapter", 0, r=4,
                                                        target_modules=["q_proj", "v_proj", "down_proj"])))
    rows = [row for row in _rows(12) if "prompt" in row]
    out = _by_id(_processor(chat_model_dir, lora_request=adapter)(ray.data.from_items(rows)).take_all())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        llm = LLM(chat_model_dir, enable_lora=True, **ENGINE_KWARGS)
        prompts = [row["prompt"] for row in rows]
        expected = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=adapter)
        base = llm.generate(prompts, GREEDY, use_tqdm=False)
    finally:
        torch.set_num_threads(threads)
    got = [out[row["id"]]["generated_token_ids"] for row in rows]
    assert got == [o.outputs[0].token_ids for o in expected]
    assert got != [o.outputs[0].token_ids for o in base]


def test_each_row_names_its_own_adapter_by_lora_path(ray_cluster, chat_model_dir, tmp_path):
    """A "lora_path" column (null: the base model) and a LoRARequest that preprocess returns:
    each row's tokens are one LLM's for its adapter; a row naming a missing directory fails alone."""
    from contbatch import LoRARequest
    from tests.conftest import make_peft_adapter

    dirs = [str(make_peft_adapter(chat_model_dir, tmp_path / f"adapter{i}", i, scale=4.0, r=4,
                                  target_modules=["q_proj", "v_proj", "down_proj"])) for i in range(2)]
    paths = [dirs[0], None, dirs[1], dirs[0], None, dirs[1], str(tmp_path / "nowhere")]
    rows = [{"id": i, "prompt": f"Row {i}: word", "lora_path": path} for i, path in enumerate(paths)]
    by_preprocess = LoRARequest("direct", 7, dirs[1])

    def preprocess(row: dict) -> dict:
        return {**row, "lora_request": by_preprocess} if row["id"] == 1 else row

    processor = _processor(chat_model_dir, engine_kwargs={**ENGINE_KWARGS, "enable_lora": True, "max_loras": 2},
                           preprocess=preprocess)
    out = _by_id(processor(ray.data.from_items(rows)).take_all())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        llm = LLM(chat_model_dir, enable_lora=True, max_loras=2, **ENGINE_KWARGS)
        loras = [LoRARequest("a", 1, dirs[0]), by_preprocess, LoRARequest("b", 2, dirs[1])]
        loras = [loras[0], loras[1], loras[2], loras[0], None, loras[2]]
        expected = llm.generate([row["prompt"] for row in rows[:6]], GREEDY, use_tqdm=False, lora_request=loras)
        base = llm.generate([row["prompt"] for row in rows[:6]], GREEDY, use_tqdm=False)
    finally:
        torch.set_num_threads(threads)
    got = [out[i]["generated_token_ids"] for i in range(6)]
    assert got == [o.outputs[0].token_ids for o in expected]
    assert got != [o.outputs[0].token_ids for o in base]
    assert "nowhere' is not a directory" in out[6]["error"] and out[6]["generated_token_ids"] is None


def test_a_row_naming_an_adapter_is_refused_where_the_actors_serve_none(reference_llm):
    from contbatch.integrations.ray import _engine_prompt
    from contbatch.lora.by_path import AdaptersByPath

    with pytest.raises(ValueError, match=r"engine_kwargs=\{'enable_lora': True\}"):
        _engine_prompt({"prompt": "x", "lora_path": "/adapters/a"}, reference_llm, GREEDY, AdaptersByPath())
    with pytest.raises(TypeError, match="a row's 'lora_path' must be a LoRA adapter directory"):
        _engine_prompt({"prompt": "x", "lora_path": 3}, reference_llm, GREEDY, AdaptersByPath())
    assert _engine_prompt({"prompt": "x"}, reference_llm, GREEDY, AdaptersByPath())["lora_request"] is None
