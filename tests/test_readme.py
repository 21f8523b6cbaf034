"""The README's promises: CI runs exactly the README's test command, its commands and examples run as
printed, it stays a guide, and the pages it links to name what exists."""

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    block = re.search(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    return [line for line in block.splitlines() if line and not line.startswith("#")]


def test_readme_opens_with_two_commands_and_ci_runs_the_second():
    commands = readme_commands()
    assert len(commands) == 2
    assert "jaxtune" in commands[0] and "pytest" in commands[1]
    assert commands[1] in (ROOT / ".ci" / "run").read_text()


def test_lm_eval_is_named_by_the_command_that_registers_jaxtune():
    """`lm_eval --model jaxtune` finds no such model (lm-eval 0.4 loads no plugins): wherever the README and docs/
    give lm-eval's `--model jaxtune`, they give it through `python -m jaxtune.harness run`, which registers it
    (tests/test_harness.py runs that command)."""
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for line in page.read_text().splitlines():
            if "--model jaxtune" in line:
                assert "python -m jaxtune.harness run --model jaxtune" in line, f"{page.name}: {line}"
            assert not re.search(r"\blm[-_]eval\s+(?:run\s+)?--model\s+jaxtune", line), f"{page.name}: {line}"


def test_readme_python_examples_import_what_they_name():
    """Every `from jaxtune... import a, b` line of the Python examples of the README and docs/ names something that
    exists (but the module the objective recipe of docs/architecture.md creates)."""
    import importlib

    missing = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for block in re.findall(r"```python\n(.*?)```", page.read_text(), re.S):
            for module, names in re.findall(r"^\s*from (jaxtune\S*) import ([^#\n]+)", block, re.M):
                if module == recipe_module()[1]:
                    continue
                loaded = importlib.import_module(module)
                for name in names.replace("(", "").replace(")", "").split(","):
                    name = name.strip().split(" as ")[0]
                    if name and not hasattr(loaded, name):
                        missing.append(f"{page.name}: {module}.{name}")
    assert not missing, missing


PAGES = ("README.md", "CHANGELOG.md", "benchmarks/README.md", "experiments/README.md", "docs")


def markdown_pages() -> list[Path]:
    return sorted(p for name in PAGES for p in ([ROOT / name] if name.endswith(".md") else (ROOT / name).glob("*.md")))


def outside_code(text: str) -> str:
    """`text` without its fenced blocks and inline code spans."""
    return re.sub(r"`[^`\n]*`", "", re.sub(r"^```.*?^```", "", text, flags=re.S | re.M))


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> list[str]:
    """The anchors of `page`'s headings, in order (a repeated one numbered, as GitHub does)."""
    found, seen = [], {}
    for heading in re.findall(r"^#{1,6} (.*)", re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M), re.M):
        base = slug(heading)
        found.append(f"{base}-{seen[base]}" if base in seen else base)
        seen[base] = seen.get(base, 0) + 1
    return found


def test_readme_is_a_guide_with_a_table_of_contents():
    """The README stays a guide: at most 320 lines, and a table of contents that links each of its sections by an
    anchor that exists."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 320, "the README is a guide: details go to docs/, evidence beside its script"
    contents = next(p for p in text.split("\n\n") if p.startswith("**Contents**"))
    linked = re.findall(r"\]\(#([^)]+)\)", contents)
    sections = [slug(h) for h in re.findall(r"^## (.*)", outside_code(text), re.M)]
    assert linked == sections, (linked, sections)
    assert set(linked) <= set(anchors(ROOT / "README.md"))


def test_relative_links_point_to_what_exists():
    """Every relative link of the README, docs/*.md, the benchmarks' and experiments' READMEs and the changelog
    names a file that exists, and a heading its page has."""
    broken = []
    for page in markdown_pages():
        for target in re.findall(r"\]\(([^)\s]+)\)", outside_code(page.read_text())):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}: no such file")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                broken.append(f"{page.relative_to(ROOT)}: {target}: no such heading")
    assert not broken, "\n".join(broken)


ARCHITECTURE = ROOT / "docs" / "architecture.md"


def recipe_module() -> tuple[str, str]:
    """The path and module name of the worked objective of docs/architecture.md, which its recipe creates."""
    (path,) = re.findall(r"^# (jaxtune/objectives/\w+\.py)$", ARCHITECTURE.read_text(), re.M)
    return path, path.removesuffix(".py").replace("/", ".")


def test_architecture_names_what_exists():
    """Every jaxtune path and dotted name, and every tests/ file, docs/architecture.md mentions exists: a file or a
    folder, or a module and the attributes after it (but the module its objective recipe creates)."""
    import importlib

    text, (recipe_path, recipe_name) = ARCHITECTURE.read_text(), recipe_module()
    missing = [path for path in set(re.findall(r"\b(?:jaxtune|tests)/[\w/]*(?:\.py)?", text)) - {recipe_path}
               if not (ROOT / path).exists()]
    for name in set(re.findall(r"\bjaxtune(?:\.[A-Za-z_]\w*)+", text)) - {recipe_name}:
        parts = name.split(".")
        for cut in range(len(parts), 0, -1):
            try:
                found = importlib.import_module(".".join(parts[:cut]))
                break
            except ModuleNotFoundError:
                continue
        for attribute in parts[cut:]:
            found = getattr(found, attribute, missing)
        if found is missing:
            missing.append(name)
    assert not missing, missing


def test_the_objective_recipe_runs_through_the_spine(monkeypatch):
    """The worked objective of docs/architecture.md, registered as the recipe says, gives the spine a step: its
    module builds an Objective, and a LoRA run of it on a tiny model traces to a loss."""
    import jax

    from jaxtune.config import ForwardOptions, MeshConfig, tiny_config
    from jaxtune.config.plan import TrainPlan
    from jaxtune.methods import method_config
    from jaxtune.objectives import OBJECTIVES
    from jaxtune.objectives.base import Objective
    from jaxtune.parallel import make_mesh
    from jaxtune.spine import abstract_run

    path, name = recipe_module()
    (example,) = [b for b in blocks(ARCHITECTURE.read_text(), "python") if b.startswith(f"# {path}\n")]
    namespace = {"__name__": name}
    exec(compile(example, str(ARCHITECTURE), "exec"), namespace)
    (objective,) = [v for v in namespace.values() if isinstance(v, Objective)]
    monkeypatch.setitem(OBJECTIVES, objective.name, objective)
    plan = TrainPlan(method_config("lora", rank=4), forward=ForwardOptions(compute_dtype="float32"), batch_size=2,
                     seq_len=32, param_dtype="float32", mesh=MeshConfig(fsdp=1), objective=objective.name)
    run = abstract_run(tiny_config(), plan, make_mesh(plan.mesh, jax.devices()[:1]))
    _, metrics = jax.eval_shape(run.step, run.state, run.frozen, run.second, run.batch)
    assert metrics["loss"].shape == () and metrics["loss_tokens"].shape == ()


def section(title: str) -> str:
    """The README's text from the heading `title` to the next heading of its level or above (outside code)."""
    level, lines, fenced = title.split(" ")[0], [], False
    for line in (ROOT / "README.md").read_text().splitlines(keepends=True):
        fenced ^= line.startswith("```")
        heading = not fenced and re.match(r"#+ ", line)
        if lines and heading and len(heading.group(0)) - 1 <= len(level):
            break
        if lines or line.rstrip("\n") == title:
            lines.append(line)
    return "".join(lines)


def blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, re.S)


def run_printed(command: str, cwd: Path) -> subprocess.CompletedProcess:
    """A README command line, comments dropped, `jaxtune` as this interpreter's module."""
    argv = shlex.split(command, comments=True)
    assert argv[0] == "jaxtune", command
    return subprocess.run([sys.executable, "-m", "jaxtune.cli", *argv[1:]], cwd=cwd, capture_output=True, text=True,
                          timeout=900)


@pytest.mark.reference
@pytest.mark.slow
@pytest.mark.full
def test_your_first_fine_tune_runs_as_printed(tmp_path):
    """"Your first fine-tune": its data lines as train.jsonl, its config as first.toml, its commands one after the
    other, all as printed — with a tiny Llama written as a Q4_1 GGUF file in SmolLM2's place (same name, a chat
    template of its own). Each command succeeds and the run directory holds what the section says."""
    from gguf import GGMLQuantizationType
    from gguf_files import write_gguf
    from hf_models import make_hf_model
    from test_gguf import OVERRIDES, SHAPE

    text = section("## Your first fine-tune")
    (data,), (config,), (commands,) = blocks(text, "jsonl"), blocks(text, "toml"), blocks(text, "bash")
    model = make_hf_model("llama", tmp_path / "hf", **{**SHAPE, **OVERRIDES["llama"]})
    name = re.search(r'^path = "(.*?)"', config, re.M).group(1)
    write_gguf(tmp_path / name, model, GGMLQuantizationType.Q4_1)
    records = [json.loads(line) for line in data.splitlines()]
    assert {"prompt", "instruction", "messages"} <= {k for r in records for k in r}
    (tmp_path / "train.jsonl").write_text(data * 10)
    (tmp_path / "first.toml").write_text(config)
    lines = [line for line in commands.splitlines() if line.strip()]
    assert len(lines) == 4
    for line in lines:
        done = run_printed(line, tmp_path)
        assert done.returncode == 0, (line, done.stderr[-3000:])
    run = tmp_path / "runs" / "first"
    assert {p.name for p in run.iterdir()} >= {"config.toml", "metrics.jsonl", "loss.png", "checkpoints", "adapter"}
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps if "loss" in r] == [10, 20, 30, 40]
    assert {0, 20, 40} <= {r["step"] for r in steps if "eval_loss" in r}
    assert (tmp_path / "first.gguf").stat().st_size > 0


@pytest.mark.slow
@pytest.mark.full
def test_the_instruction_fine_tuning_config_trains_as_printed(tmp_path):
    """The README's config of every key ("Configuration"), as printed, where a new user runs it: a tiny model at its
    `path/to/hf-model` and a few dozen lines at its `train.jsonl` (it once crashed at its last step there, its
    profile window past the end). It trains to the end and writes its adapter and TensorBoard events."""
    from jaxtune.presets import write_random_model

    (config,) = [b for b in blocks(section("## Configuration"), "toml") if "every key" in b]
    write_random_model(tmp_path / "path" / "to" / "hf-model", "llama", seed=0)
    demo = ROOT / "jaxtune" / "assets" / "demo_instructions.jsonl"
    (tmp_path / "train.jsonl").write_text("".join(demo.read_text().splitlines(keepends=True)[:60]))
    (tmp_path / "run.toml").write_text(config)
    done = run_printed("jaxtune train run.toml", tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "jaxtune: warning: train.profile_steps = [20, 22] starts after the run's last step" in done.stderr
    run = tmp_path / "runs" / "my-run"
    assert (run / "adapter" / "adapter_model.safetensors").is_file() and any((run / "tensorboard").iterdir())


@pytest.mark.reference
@pytest.mark.slow
@pytest.mark.full
def test_the_notebook_examples_run_as_printed(tmp_path, monkeypatch):
    """The newcomer's notebook path, executed as printed in one namespace, in order: "From a notebook" (a model
    loaded, run and saved; a GGUF chat model generating, the demo, the llama.cpp exports) and the fine-tune of
    "Configuration" on its run.toml. Tiny models stand where real ones are named: HF directories at the
    printed paths, and a Q4_1 GGUF with a chat template where SmolLM2 would be."""
    from gguf import GGMLQuantizationType
    from gguf_files import write_gguf
    from hf_models import make_hf_model
    from test_gguf import OVERRIDES, SHAPE

    import jaxtune.demo
    from jaxtune.presets import write_random_model

    monkeypatch.chdir(tmp_path)
    for name in ("Llama-3.2-1B", "hf-model"):
        write_random_model(tmp_path / "path" / "to" / name, "llama", seed=0)
    gguf = write_gguf(tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf",
                      make_hf_model("llama", tmp_path / "hf", **{**SHAPE, **OVERRIDES["llama"]}),
                      GGMLQuantizationType.Q4_1)
    monkeypatch.setattr(jaxtune.demo, "smollm2_path", lambda: gguf)
    (config,) = [b for b in blocks(section("## Configuration"), "toml") if "every key" in b]
    (tmp_path / "run.toml").write_text(config)
    demo = ROOT / "jaxtune" / "assets" / "demo_instructions.jsonl"
    (tmp_path / "train.jsonl").write_text("".join(demo.read_text().splitlines(keepends=True)[:60]))
    notebook = blocks(section("## From a notebook"), "python")
    fine_tune = [b for b in blocks(section("## Configuration"), "python") if "fine_tune(" in b]
    assert len(notebook) == 2 and len(fine_tune) == 1
    namespace = {}
    for block in [*notebook, *fine_tune]:
        exec(compile(block, "README.md", "exec"), namespace)
    assert namespace["logits"].shape[:2] == namespace["ids"].shape
    assert (tmp_path / "out" / "config.json").is_file()
    assert {"correct_before", "correct_after"} <= set(namespace["summary"])
    assert (tmp_path / "dates-f16.gguf").stat().st_size > 0 and (tmp_path / "dates-lora.gguf").stat().st_size > 0
    assert namespace["result"].result_path == Path("runs/my-run/adapter")


def test_the_scale_out_page_shows_the_rules_table_the_code_has():
    """docs/scale-out.md's table of logical axes is `parallel.rules.RULES`, row for row."""
    from jaxtune.parallel.rules import RULES

    def words(cell: str) -> tuple[str, ...]:
        return tuple(w.strip() for w in cell.split(",") if w.strip() and not w.strip().startswith("never"))

    table = {}
    for line in (ROOT / "docs" / "scale-out.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue
        for name in re.findall(r"`(\w+)`", cells[0].split("(")[0]):
            table[name] = (words(cells[1]), words(cells[2]))
    assert table == {name: (split, fallback) for name, split, fallback in RULES}
