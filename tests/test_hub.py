"""Models and datasets by Hub id, and pushes (`jaxtune.hub`, `train.card`), offline: a local Hub cache layout
(tests/fake_hub.py's `hub_cache`) with HF_HUB_OFFLINE, and a fake endpoint on 127.0.0.1 for downloads and uploads."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from fake_hub import FakeHub, directory_files, hub_cache

from jaxtune import cli
from jaxtune.data.sources import read_records
from jaxtune.data.tokenizer import TOKENIZER_FILES
from jaxtune.errors import JaxtuneError, JaxtuneWarning
from jaxtune.hub import INDEX, MODEL_FILES, local_dataset, local_model
from jaxtune.models.hf_config import load_config
from jaxtune.planner.command import plan_from_run_config
from jaxtune.presets import write_random_model
from jaxtune.run_config import load_run_config, with_local_inputs, with_local_models
from jaxtune.train.card import push_run_result
from jaxtune.train.loop import fine_tune

ROWS = [{"question": f"Q: {a}+{b}?\nA:", "answer": f" {a + b}"} for a in range(4) for b in range(3)]


def parquet_bytes(rows: list[dict], path: Path) -> bytes:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path.read_bytes()


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    """The huggingface_hub cache in tmp_path, downloads off (HF_HUB_OFFLINE), as the CLI's processes see it too."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    hub = FakeHub({})
    hub.use(monkeypatch, tmp_path / "hub")
    yield hub
    hub.close()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return write_random_model(tmp_path_factory.mktemp("model") / "model", "llama", seed=0)


def cached_ids(cache: Path, model: Path, tmp_path: Path) -> tuple[Path, Path]:
    """me/tiny (`model`'s files) and me/data (ROWS as its train split, four of them as test) in `cache`."""
    snapshot = hub_cache(cache, "me/tiny", directory_files(model))
    data = hub_cache(cache, "me/data", {"data/train-00000-of-00001.parquet": parquet_bytes(
        ROWS, tmp_path / "rows.parquet"), "data/test-00000-of-00001.parquet": parquet_bytes(ROWS[:4], tmp_path / "t")},
        kind="datasets")
    return snapshot, data


def test_a_run_config_resolves_its_ids_from_the_cache(tiny_model, offline_cache, tmp_path):
    """What a run does first (`with_local_inputs`, the full tier's run below): [model] path and [data] train/eval
    as the cached snapshot and its Parquet splits (eval without a validation split: test), read as written; an
    objective's model fields (a distillation teacher, a DPO reference) by id too, "base" left as it is."""
    snapshot, data = cached_ids(offline_cache, tiny_model, tmp_path)
    config = with_local_inputs(load_run_config(None, ["model.path=me/tiny", "data.train=me/data",
                                                      "data.eval=me/data"]))
    assert (config.model.path, config.data.train, config.data.eval) == (
        str(snapshot), str(data / "data/train-*.parquet"), str(data / "data/test-*.parquet"))
    assert load_config(config.model.path) == load_config(tiny_model)
    assert [r for _, r in read_records(config.data.eval)] == ROWS[:4]
    teacher = hub_cache(offline_cache, "me/teacher", directory_files(write_random_model(
        tmp_path / "teacher", "llama", seed=1, hidden_size=32, head_dim=8)))
    distill = load_run_config(None, ["model.path=me/tiny", "train.objective=distill", "distill.teacher=me/teacher"])
    cfg, plan = plan_from_run_config(distill, "cpu")  # `jaxtune plan --config` reads the teacher by id too
    assert cfg == load_config(tiny_model) and plan.second_model == load_config(teacher) != cfg
    dpo = with_local_models(load_run_config(None, ["model.path=me/tiny", "train.objective=dpo",
                                                   "dpo.reference=me/tiny"]))
    assert dpo.section("dpo").reference == str(snapshot)
    assert with_local_models(load_run_config(None, ["model.path=me/tiny", "train.objective=dpo"])).section(
        "dpo").reference == "base"


@pytest.mark.full
def test_a_run_on_a_model_id_and_a_dataset_id_from_the_cache(tiny_model, offline_cache, tmp_path, monkeypatch):
    """`[model] path = "me/tiny"`, `[data] train = "me/data"`: resolved from the cache offline, the run trains on
    the snapshot's Parquet split, records the snapshot it ran on, and its adapter names the base by id. The push at
    the end fails (offline): one warning naming the repo, the adapter kept; `export --run ... --push` sends it later
    with the run's card."""
    snapshot, data = cached_ids(offline_cache, tiny_model, tmp_path)
    (tmp_path / "run.toml").write_text(
        '[model]\npath = "me/tiny"\n[method]\nkind = "lora"\n[data]\ntrain = "me/data"\neval = "me/data"\n'
        'max_seq_len = 32\ncolumns = {prompt = "question", completion = "answer"}\n'
        f'[train]\noutput_dir = "{tmp_path / "run"}"\nmax_steps = 2\nbatch_size = 4\nlog_every = 1\n'
        'push_to_hub = "me/tuned"\n')
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fine_tune(load_run_config(tmp_path / "run.toml"), log=lambda _: None)
    recorded = load_run_config(tmp_path / "run" / "config.toml")
    assert recorded.model.path == str(snapshot)
    assert recorded.data.train == str(data / "data/train-*.parquet")
    assert recorded.data.eval == str(data / "data/test-*.parquet")  # no validation split: test
    assert json.loads((result.result_path / "adapter_config.json").read_text())["base_model_name_or_path"] == "me/tiny"
    assert result.step == 2 and result.eval_loss is not None
    pushed = [str(w.message) for w in caught if issubclass(w.category, JaxtuneWarning)]
    assert len(pushed) == 1 and "\n" not in pushed[0], pushed
    assert pushed[0].startswith("train.push_to_hub: me/tuned: pushing to the Hub:") and str(result.result_path) in \
        pushed[0]
    assert (result.result_path / "adapter_model.safetensors").is_file()
    hub = FakeHub({})  # online now: the command the warning names pushes it later, with the run's card
    try:
        hub.use(monkeypatch, offline_cache)
        assert cli.main(["export", "--run", str(tmp_path / "run"), "--peft", str(tmp_path / "later"),
                         "--push", "me/tuned"]) == 0
    finally:
        hub.close()
    assert {k: v for k, v in hub.pushed["me/tuned"].items() if k != "README.md"} == directory_files(
        tmp_path / "later")
    card = hub.pushed["me/tuned"]["README.md"].decode()
    assert yaml.safe_load(card.split("---\n")[1])["datasets"] == ["me/data"]
    last = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert f"| train_loss | {[r for r in last if 'loss' in r][-1]['loss']:.6g} |" in card


def test_push_writes_the_result_and_its_card(tmp_path, fake_hub, monkeypatch):
    """`push_run_result`: the result's files as they are, and a README.md whose front matter the Hub reads
    (base_model, library_name, tags, datasets) and whose table holds the run's final metrics."""
    from huggingface_hub import constants

    snapshot = hub_cache(Path(constants.HF_HUB_CACHE), "me/tiny", {"config.json": b"{}"})
    data = hub_cache(Path(constants.HF_HUB_CACHE), "me/data", {"data/train.parquet": b""}, kind="datasets")
    run_dir, adapter = tmp_path / "run", tmp_path / "run" / "adapter"
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    (adapter / "adapter_model.safetensors").write_bytes(b"weights")
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 2.5}\n{"step": 2, "loss": 2.25}\n'
                                           '{"step": 2, "eval_loss": 2.4, "eval_perplexity": 11.02}\n')
    config = load_run_config(None, [f"model.path={snapshot}", f"data.train={data / 'data/train.parquet'}",
                                    "train.push_to_hub=me/tuned", "method.kind=ia3"])
    url = push_run_result(run_dir, config, adapter, log=lambda _: None)
    assert url.startswith(f"{fake_hub.url}/me/tuned/commit/")
    files = fake_hub.pushed["me/tuned"]
    assert set(files) == {"adapter_config.json", "adapter_model.safetensors", "README.md"}
    assert files["adapter_model.safetensors"] == b"weights"
    card = files["README.md"].decode()
    assert fake_hub.cards == [card]
    front = yaml.safe_load(card.split("---\n")[1])
    assert front == {"base_model": "me/tiny", "library_name": "peft", "tags": ["jaxtune", "ia3", "sft"],
                     "datasets": ["me/data"]}
    assert "A ia3 fine-tune (sft) of [me/tiny](https://huggingface.co/me/tiny)" in card
    assert "| train_loss | 2.25 |" in card and "| eval_loss | 2.4 |" in card and "| step | 2 |" in card
    fake_hub.fail_pushes = True
    with pytest.warns(JaxtuneWarning, match=r"train.push_to_hub: me/tuned: pushing to the Hub: HfHubHTTPError: .*500"
                                            r".*the result stays in .*adapter \(push it later: jaxtune export --run"):
        assert push_run_result(run_dir, config, adapter, log=lambda _: None) is None
    assert (adapter / "adapter_model.safetensors").read_bytes() == b"weights"


def test_only_what_a_run_reads_is_downloaded(tiny_model, fake_hub, capsys):
    """A model id fetches config, tokenizer and the safetensors (the index's shards when sharded), never the
    pickles or another copy of the weights beside them; a GGUF id fetches its one file."""
    decoys = {"pytorch_model.bin": b"pickle", "training_args.bin": b"pickle", "optimizer.pt": b"pickle",
              "consolidated.safetensors": b"mistral's copy", "model-Q4_K_M.gguf": b"GGUF"}
    index = {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                            "b": "model-00002-of-00002.safetensors"}}
    sharded = {"config.json": b'{"a": 1}', INDEX: json.dumps(index).encode(),
               "model-00001-of-00002.safetensors": b"1", "model-00002-of-00002.safetensors": b"2", **decoys}
    fake_hub.repos.update({("models", "me/tiny", "main"): {**directory_files(tiny_model), **decoys},
                           ("models", "me/sharded", "v1"): sharded})
    assert cli.main(["info", "--model", "me/tiny", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["architecture"] == "LlamaForCausalLM"
    assert sorted(fake_hub.downloads) == sorted(f"models/me/tiny/{f}" for f in directory_files(tiny_model))
    fake_hub.downloads.clear()
    assert Path(local_model("me/sharded@v1"), "model-00002-of-00002.safetensors").read_bytes() == b"2"
    assert sorted(fake_hub.downloads) == sorted(f"models/me/sharded/{f}" for f in sharded if f not in decoys)
    fake_hub.downloads.clear()
    assert Path(local_model("me/sharded/model-Q4_K_M.gguf@v1")).read_bytes() == b"GGUF"
    assert fake_hub.downloads == ["models/me/sharded/model-Q4_K_M.gguf"]
    assert set(TOKENIZER_FILES) <= set(MODEL_FILES)  # every file the tokenizer reads is fetched


def test_datasets_by_id_read_their_parquet_splits(tmp_path, fake_hub):
    """The repo's data/<split>-*.parquet shards in order; without them the Hub's refs/convert/parquet branch; a
    split that is in neither is one line naming what was looked for."""
    shards = {f"data/train-0000{i}-of-00002.parquet": parquet_bytes(ROWS[6 * i:6 * i + 6], tmp_path / f"{i}.parquet")
              for i in range(2)}
    fake_hub.repos.update({("datasets", "me/data", "main"): {"README.md": b"card", **shards},
                           ("datasets", "me/raw", "main"): {"raw.csv": b"a,b"},
                           ("datasets", "me/raw", "refs/convert/parquet"): {
                               "default/validation/0000.parquet": parquet_bytes(ROWS[:3], tmp_path / "v.parquet")}})
    assert [r for _, r in read_records(local_dataset("me/data", ("train",)))] == ROWS
    assert sorted(fake_hub.downloads) == sorted(f"datasets/me/data/{f}" for f in shards)  # not its README
    assert [r for _, r in read_records(local_dataset("me/raw", ("validation", "test")))] == ROWS[:3]
    with pytest.raises(JaxtuneError, match=r"^me/raw:test: the Hub dataset has no Parquet files of split test \("
                                           r"looked for data/test-\*.parquet, data/test.parquet at main; "
                                           r"default/test/\*.parquet at refs/convert/parquet\)$"):
        local_dataset("me/raw:test", ("train",))


def test_offline_a_missing_file_or_an_unknown_id_is_one_line(tiny_model, offline_cache, tmp_path, capsys,
                                                             monkeypatch):
    files = directory_files(tiny_model)
    hub_cache(offline_cache, "me/tiny", {k: v for k, v in files.items() if k != "model.safetensors"})
    assert cli.main(["info", "--model", "me/tiny"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("jaxtune: error: me/tiny: model.safetensors is not in the Hub "
                                                   "repo's snapshot"), err
    assert cli.main(["generate", "--model", "me/absent@v2", "--prompt", "hi"]) == 2
    assert capsys.readouterr().err == ("jaxtune: error: me/absent@v2: not a local path, and as a Hub model id: not "
                                       "in the Hugging Face cache, and downloads are off (HF_HUB_OFFLINE=1) or the "
                                       "Hub cannot be reached\n")
    with pytest.raises(JaxtuneError, match=r"^me/a--b: not a local path, and as a Hub model id: not a valid repo id"):
        local_model("me/a--b")
    assert local_dataset("data/train.jsonl", ("train",)) == "data/train.jsonl"  # a file, left to its reader
    assert local_model("models/m.gguf") == "models/m.gguf"
    monkeypatch.chdir(tmp_path)  # a local directory named like an id wins
    (tmp_path / "me" / "tiny").mkdir(parents=True)
    assert local_model("me/tiny") == "me/tiny" and local_dataset("me/tiny", ("train",)) == "me/tiny"


def test_export_push_uploads_the_merged_model_with_its_card(tiny_model, fake_hub, tmp_path, capsys):
    """`jaxtune export --model me/tiny --merged OUT --push me/copy`: OUT written and kept, the same files pushed
    with a card naming the base model."""
    fake_hub.repos[("models", "me/tiny", "main")] = directory_files(tiny_model)
    assert cli.main(["export", "--model", "me/tiny", "--merged", str(tmp_path / "out"), "--push", "me/copy"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith(f"pushed {tmp_path / 'out'} to {fake_hub.url}/me/copy")
    pushed = fake_hub.pushed["me/copy"]
    assert {k: v for k, v in pushed.items() if k != "README.md"} == directory_files(tmp_path / "out")
    front = yaml.safe_load(pushed["README.md"].decode().split("---\n")[1])
    assert front == {"base_model": "me/tiny", "library_name": "transformers", "tags": ["jaxtune", "merged"]}
    assert cli.main(["export", "--model", "me/tiny", "--merged", str(tmp_path / "o2"), "--push", "not an id"]) == 2
    last = capsys.readouterr().err.splitlines()[-1]  # after the download's progress
    assert last == "jaxtune: error: --push not an id: needs a Hub repo id, owner/name"
    assert not (tmp_path / "o2").exists()
