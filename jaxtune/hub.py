"""Models and datasets by Hub id, through `huggingface_hub` (its cache, token, HF_HUB_OFFLINE, HF_HOME, HF_ENDPOINT).

    local_model("Qwen/Qwen3-0.6B@main")            # the snapshot dir: config, tokenizer, the safetensors shards
    local_model("owner/name-GGUF/model-Q4_K_M.gguf")  # that one file of the repo
    local_dataset("owner/data:test", ("test",))   # "<snapshot>/data/test-*.parquet" (`data.sources` reads globs)
    push("runs/run/adapter", "me/my-adapter", card)     # the folder (or one file) and README.md, as one commit
A local path always wins; only what a run reads is downloaded (never *.bin or pickles). Ids in a run: `hub_id_of`.
"""

from __future__ import annotations

import re
from pathlib import Path

from jaxtune.errors import JaxtuneError
from jaxtune.io.json import read_json

# `owner/name`, a GGUF file's `owner/name/path/file.gguf`, then `@revision`; a dataset's `:split` last
_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?P<file>/[^@:]+\.gguf)?(?:@(?P<rev>[^:\s]+))?"
                 r"(?::(?P<split>[\w.-]+))?")
# what a run reads of a model repo besides its weights (config, tokenizer, chat template, image processor)
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "chat_template.jinja", "chat_template.json", "preprocessor_config.json",
               "processor_config.json", "model.safetensors.index.json")
FILE_SUFFIXES = (".jsonl", ".json", ".gz", ".parquet", ".arrow", ".csv", ".gguf", ".safetensors")
WEIGHTS, INDEX = "model.safetensors", "model.safetensors.index.json"
OWN_LAYOUT = ("data/{}-*.parquet", "data/{}.parquet")  # a dataset repo's split files, as `datasets` pushes them
PARQUET_BRANCH = "refs/convert/parquet"  # the Hub's Parquet conversion of any dataset: <config>/<split>/NNNN.parquet
CONVERTED_LAYOUT = ("default/{}/*.parquet",)


def parse_id(ref: str, splits: bool = False) -> dict | None:
    """{"repo", "file", "rev", "split"} of a Hub reference, or None when `ref` is not one (or is a local path)."""
    match = _ID.fullmatch(str(ref))
    if match is None or Path(ref).exists() or (match["split"] and not splits) or (match["file"] and splits):
        return None
    if match["repo"].endswith(FILE_SUFFIXES):  # `data/train.jsonl`: a local file that is not there, said as such
        return None
    return match.groupdict()


def local_model(ref: str | Path) -> str:
    """`ref` itself when it is a local path; else the local copy of the Hub model it names (downloaded into the
    Hugging Face cache when missing: `MODEL_FILES` and the safetensors shards, or the one GGUF file). Raises a
    JaxtuneError naming `ref` when it is neither."""
    hub = parse_id(str(ref))
    if hub is None:
        return str(ref)
    from huggingface_hub import hf_hub_download, snapshot_download

    repo, rev = hub["repo"], hub["rev"]
    with _one_line(str(ref), "not a local path, and as a Hub model id"):
        if hub["file"]:
            return hf_hub_download(repo, hub["file"].lstrip("/"), revision=rev)
        snapshot = Path(snapshot_download(repo, revision=rev, allow_patterns=list(MODEL_FILES)))
        index = snapshot / INDEX
        shards = sorted(set(read_json(index)["weight_map"].values())) if index.is_file() else [WEIGHTS]
        snapshot = Path(snapshot_download(repo, revision=rev, allow_patterns=shards))
    for name in ["config.json", *shards]:
        if not (snapshot / name).is_file():
            raise JaxtuneError(f"{ref}: {name} is not in the Hub repo's snapshot {snapshot} (offline, or not "
                               "downloaded: run once online, or unset HF_HUB_OFFLINE)")
    return str(snapshot)


def local_dataset(ref: str | Path, splits: tuple[str, ...]) -> str:
    """`ref` itself when it is a local path; else a glob of the local Parquet files of the Hub dataset it names
    (`owner/name[@revision][:split]`; no split: the first of `splits` the repo has): the repo's own
    `data/<split>-*.parquet` (or `data/<split>.parquet`), else the Hub's Parquet conversion (`refs/convert/parquet`,
    the default config). Raises a JaxtuneError naming `ref` when it is neither."""
    hub = parse_id(str(ref), splits=True)
    if hub is None:
        return str(ref)
    from huggingface_hub import snapshot_download

    wanted = (hub["split"],) if hub["split"] else splits
    tried = []
    for rev, layout in ((hub["rev"], OWN_LAYOUT), (PARQUET_BRANCH, CONVERTED_LAYOUT)):
        patterns = [p.format(s) for s in wanted for p in layout]
        try:
            with _one_line(str(ref), "not a local path, and as a Hub dataset id"):
                snapshot = Path(snapshot_download(hub["repo"], repo_type="dataset", revision=rev,
                                                  allow_patterns=patterns))
        except JaxtuneError:
            if rev != PARQUET_BRANCH:
                raise
            break  # no conversion branch (or not cached): the line below says what was looked for
        for pattern in patterns:
            if any(snapshot.glob(pattern)):
                return str(snapshot / pattern)
        tried.append(f"{', '.join(patterns)} at {rev or 'main'}")
    raise JaxtuneError(f"{ref}: the Hub dataset has no Parquet files of split {' or '.join(wanted)} "
                       f"(looked for {'; '.join(tried)})")


def push(path: str | Path, repo_id: str, card: str) -> str:
    """Upload the directory (or the one file) `path` to the Hub model repo `repo_id` (created if missing) with `card`
    as its README.md, in one commit; the commit's URL. A failure is one JaxtuneError naming the repo."""
    from huggingface_hub import CommitOperationAdd, HfApi

    path = Path(path)
    files = {path.name: path} if path.is_file() else {
        p.relative_to(path).as_posix(): p for p in sorted(path.rglob("*")) if p.is_file()}
    files.pop("README.md", None)
    with _one_line(repo_id, "pushing to the Hub"):
        api = HfApi()
        api.create_repo(repo_id, exist_ok=True)
        operations = [CommitOperationAdd(name, str(p)) for name, p in files.items()]
        operations.append(CommitOperationAdd("README.md", card.encode()))
        return api.create_commit(repo_id, operations, commit_message=f"jaxtune: {path.name}").commit_url


def hub_id_of(path: str | Path) -> str | None:
    """`owner/name` when `path` lies in a Hugging Face cache snapshot (`.../models--owner--name/snapshots/<rev>/...`,
    as `local_model` gives), else None: the id a model card or adapter config names."""
    parts = Path(path).parts
    for i, part in enumerate(parts[:-2]):
        if part.startswith(("models--", "datasets--")) and parts[i + 1] == "snapshots":
            return part.split("--", 1)[1].replace("--", "/")
    return None


class _one_line:
    """A `huggingface_hub` failure as one JaxtuneError naming the reference (not found, gated, offline, no network)."""

    def __init__(self, ref: str, doing: str):
        self.ref, self.doing = ref, doing

    def __enter__(self):
        return self

    def __exit__(self, kind, e, tb):
        if e is None or isinstance(e, JaxtuneError):
            return False
        from huggingface_hub import errors

        reason = {errors.GatedRepoError: "a gated repo: accept its terms on the Hub and log in (HF_TOKEN)",
                  errors.LocalEntryNotFoundError: "not in the Hugging Face cache, and downloads are off "
                                                  "(HF_HUB_OFFLINE=1) or the Hub cannot be reached",
                  errors.RevisionNotFoundError: "no such revision in the repo",
                  errors.EntryNotFoundError: "no such file in the repo",
                  errors.HFValidationError: "not a valid repo id (letters, digits, '-', '_', '.'; no '--' or '..')",
                  errors.RepositoryNotFoundError: "no such repo on the Hub (or it is private: log in "
                                                  "with `hf auth login` or set HF_TOKEN)"}
        said = next((text for cls, text in reason.items() if isinstance(e, cls)), None)
        if said is None and not isinstance(e, (errors.HfHubHTTPError, OSError)):
            return False
        raise JaxtuneError(f"{self.ref}: {self.doing}: "
                           f"{said or f'{type(e).__name__}: {str(e).splitlines()[0] if str(e) else e}'}") from None
