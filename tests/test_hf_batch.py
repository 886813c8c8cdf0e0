"""transformers models recorded batched (issue 28, point 5): ``HFAdapter.stream_batch`` feeds a prompt set's rows the
same positions in one B-row DynamicCache, as our model's batched generation does, and every row equals its single
recording: tokens identical, logprobs within 1e-5, every signal table within replay's tolerance (1e-4), on tiny
Mixtral, Qwen3-MoE, OLMoE and gpt-oss folders (gpt-oss: a sliding window of 8 and attention sinks; the longest
prompt is past the window). Families that cannot be made equal record one prompt at a time, with a note."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import workbench  # noqa: E402
from workbench.capture import prompt_sets  # noqa: E402
from workbench.capture.adapters import adapter_for, load_adapter  # noqa: E402
from workbench.capture.adapters.hf import SINGLE_ONLY  # noqa: E402
from workbench.capture.recorder import RecordSettings, new_run_id, record_batch  # noqa: E402
from workbench.capture.tiny import make_folder, tiny_family  # noqa: E402
from workbench.data import query  # noqa: E402
from workbench.data.signals import TABLES  # noqa: E402
from workbench.data.store import Store  # noqa: E402

FAMILIES = ["mixtral", "qwen3_moe", "olmoe", "gpt_oss"]
PROMPTS = ["x", "def add(a, b):", "class Point:\n    def __init__(self, x, y):\n        self.x = x\n",
           "for i in range(10):\n    print(i)"]
# per-row settings: greedy and sampled rows, different lengths of generation
SETTINGS = {"max_new_tokens": [5, 3, 8, 6], "temperature": [0.0, 1.0, 0.0, 0.7], "top_p": [1.0, 0.9, 1.0, 1.0],
            "seed": [0, 3, 0, 11]}
TOL = 1e-4  # workbench.analysis.replay's default tolerance for real-valued signals

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_batch")
    return {f: str(make_folder(f, root / f)) for f in FAMILIES}


def assert_same_signals(a: Store, run_a: str, b: Store, run_b: str, dense: bool = False) -> None:
    """Every signal table of two runs: the same rows (keys), equal exact columns, tolerance columns within ``TOL``
    (the tables' own replay classification, workbench.data.signals); logprobs within 1e-5. Every table has rows
    (``dense``: the attention table; the expert tables of a dense model have none)."""
    for name, table in TABLES.items():
        q = f"SELECT * EXCLUDE (run_id) FROM {name} WHERE run_id = ? ORDER BY {table.order}"
        x, y = a.sql(q, [run_a]), b.sql(q, [run_b])
        assert x.height == y.height and (x.height > 0 or dense and name != "attention"), name
        for c in table.names("key") + table.names("exact"):
            assert x[c].to_list() == y[c].to_list(), (name, c)
        for c in table.names("tol"):
            d = (x[c] - y[c]).abs().max()
            assert d is None or d <= (1e-5 if (name, c) == ("tokens", "logprob") else TOL), (name, c, d)


@pytest.mark.parametrize("family", FAMILIES)
def test_each_batched_row_equals_its_single_recording(family, folders, tmp_path):
    rows = [RecordSettings(**{k: v[i] for k, v in SETTINGS.items()}) for i in range(len(PROMPTS))]
    db = Store(tmp_path / "batched.duckdb")
    run_ids = [new_run_id() for _ in PROMPTS]
    adapter = load_adapter(folders[family])
    assert adapter.supports_batch
    calls = []
    batched = adapter.stream_batch

    def spy(prompts, *args):
        calls.append([len(p) for p in prompts])
        return batched(prompts, *args)

    adapter.stream_batch = spy
    errors = record_batch(PROMPTS, rows, model=adapter, db=db, run_ids=run_ids, run_fields=[None] * len(PROMPTS))
    assert errors == [None] * len(PROMPTS)
    assert len(calls) == 1 and len(set(calls[0])) == len(PROMPTS)  # one generation, prompts of different lengths
    if family == "gpt_oss":
        assert max(calls[0]) > 8 == adapter.module.config.sliding_window  # past the window
    single = Store(tmp_path / "single.duckdb")
    for i, p in enumerate(PROMPTS):
        one = workbench.record(p, model=adapter, db=single, detect=False,
                               **{k: v[i] for k, v in SETTINGS.items()})
        assert query.run_row(db, run_ids[i])["status"] == "complete"
        assert query.run_row(db, run_ids[i])["n_tokens"] == one.info["n_tokens"]
        a, b = query.tokens(single, one.run_id), query.tokens(db, run_ids[i])
        assert a["token_id"].to_list() == b["token_id"].to_list()
        assert_same_signals(single, one.run_id, db, run_ids[i])


def test_stream_batch_rows_stop_at_their_own_eos_and_equal_stream():
    """The adapter's generation itself: a row whose greedy continuation hits the end-of-sequence id stops there while
    the others go on; every row's steps equal ``stream``'s (tokens, logits within 1e-5)."""
    torch.manual_seed(0)
    adapter = adapter_for(tiny_family("mixtral"))
    prompts = [[5, 17, 42], [9, 8, 7, 6, 5, 4, 3], [200, 3, 77, 12, 5]]
    free = [list(adapter.stream(p, 6, 0.0, 1.0, 0, None)) for p in prompts]
    eos = free[1][2].next_token  # row 1 stops after its third step
    single = [list(adapter.stream(p, 6, 0.0, 1.0, 0, eos)) for p in prompts]
    got: list[list] = [[] for _ in prompts]
    for bstep in adapter.stream_batch(prompts, [6] * 3, [0.0] * 3, [1.0] * 3, [0] * 3, eos):
        for b, step in enumerate(bstep.steps):
            if step is not None:
                got[b].append(step)
    assert len(got[1]) <= 3 and got[1][-1].next_token == eos
    for mine, theirs in zip(got, single):
        assert [s.next_token for s in mine] == [s.next_token for s in theirs]
        assert [s.input_ids for s in mine] == [s.input_ids for s in theirs]
        for s, t in zip(mine, theirs):
            torch.testing.assert_close(s.logits, t.logits, atol=1e-5, rtol=0)


def test_prompt_sets_record_transformers_models_batched(folders, tmp_path, monkeypatch):
    """record_many on a transformers folder: groups of batch_size prompts in one batched generation each (no longer
    one at a time); every run equals its single recording."""
    seen = []
    real = prompt_sets.record_batch
    monkeypatch.setattr(prompt_sets, "record_batch", lambda prompts, *a, **kw: seen.append(len(prompts)) or
                        real(prompts, *a, **kw))
    db = Store(tmp_path / "set.duckdb")
    batch = workbench.record_many(PROMPTS, model=folders["qwen3_moe"], db=db, max_new_tokens=4, progress=False,
                                  detect=False, batch_size=4)
    runs = batch.runs()
    assert seen == [4] and runs.height == 4 and set(runs["status"]) == {"complete"}
    single = Store(tmp_path / "single.duckdb")
    for p, run_id in zip(runs["prompt"].to_list(), runs["run_id"].to_list()):
        one = workbench.record(p, model=folders["qwen3_moe"], db=single, detect=False, max_new_tokens=4)
        assert_same_signals(single, one.run_id, db, run_id)


def test_a_family_that_cannot_be_batched_exactly_records_one_at_a_time(monkeypatch, tmp_path):
    """A family of SINGLE_ONLY (its rows differ from their single recordings) says so in a note and a prompt set
    records it one prompt at a time."""
    assert "llama4_text" in SINGLE_ONLY
    torch.manual_seed(0)
    adapter = adapter_for(tiny_family("llama4_text"))
    assert not adapter.supports_batch
    assert any("one prompt at a time" in n for n in adapter.summary.notes)
    monkeypatch.setattr(prompt_sets, "record_batch", lambda *a, **kw: pytest.fail("batched a SINGLE_ONLY family"))
    rows = prompt_sets.record_group([{"prompt": [5, 17, 42], "key": "a"}, {"prompt": [9, 8, 7, 6], "key": "b"}],
                                    store=Store(tmp_path / "w.duckdb"), batch_id="b1", adapter=adapter,
                                    tokenizer=None, label="llama4", settings=RecordSettings(max_new_tokens=2))
    assert [r["status"] for r in rows] == ["complete", "complete"]


def test_a_window_kept_on_the_config_is_the_probes_window(tmp_path):
    """Mistral keeps its sliding window on the config only (not on the attention module): the attention probe gets
    it, so a prompt past the window has the same attention rows prefilled (single) and fed one per forward (a
    longer row of a batch)."""
    torch.manual_seed(0)
    adapter = adapter_for(tiny_family("mistral"))
    window = adapter.module.config.sliding_window
    assert window == 8 and getattr(adapter.attn[0], "sliding_window", None) is None
    assert adapter._windows == [window] * adapter.summary.n_layers and adapter.supports_batch
    prompts = [[5, 17, 42], [9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 12, 13]]
    db = Store(tmp_path / "w.duckdb")
    run_ids = [new_run_id() for _ in prompts]
    errors = record_batch(prompts, [RecordSettings(max_new_tokens=3)] * 2, model=adapter, db=db, run_ids=run_ids,
                          run_fields=[None] * 2)
    assert errors == [None, None]
    for p, run_id in zip(prompts, run_ids):
        one = workbench.record(p, model=adapter, db=db, detect=False, max_new_tokens=3)
        assert_same_signals(db, one.run_id, db, run_id, dense=True)
