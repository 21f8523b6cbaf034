"""Writes benchmarks/data/long_tailed_{train,eval}.jsonl: prompt/completion pairs of real text whose lengths follow
a long-tailed distribution, for `benchmarks/realistic_data.py`.

The text is what every Python ships: the docstrings of the standard library (modules, classes, functions, methods,
through `inspect.getdoc`) and the license texts of /usr/share/common-licenses. Four tasks a model can learn, each
with a prompt that says what is wanted:

  docstring       "Docstring of json.dumps(obj, *, skipkeys=False, ...):"  -> the docstring (its start)
  continue        "Continue <name>:" + a passage                        -> the passage's continuation
  first sentence  "First sentence of:" + a passage                      -> its first sentence
  name            "What does this document?" + a docstring              -> the object's name (and signature)

Lengths are in the byte-level tokenizer's tokens (`Tokenizer.byte_level()`: BOS + one token a byte + EOS). Each
example's total is drawn first, from a log-normal with median 150 and sigma 1.0 (redrawn outside [40, 2048]); the
train file has median 160, mean 245, p90 525, p99 1,413, max 1,857 (a cut at whitespace may shorten an example by
a few tokens; the held-out file: 170, 245, 543, 1,477, 1,542). The shape is that of real instruction data: in
LMSYS-Chat-1M's table of public sets (Zheng et al., ICLR 2024, Table 1; also ShareChat, arXiv 2512.17843, Table 1)
Alpaca's responses are 64.51 +- 64.85 tokens and its prompts 19.67 +- 15.19, a standard deviation equal to the
mean, which a log-normal matches with sigma = sqrt(ln 2) ~ 0.83; sigma 1.0 and the median of 150 give the longer
tail (to ~2,000 tokens) of the multi-turn sets the same table lists (OpenAssistant, ShareGPT). A task then fills that
total from a document long enough for it, cut at whitespace.

Held-out examples come from documents (modules, licenses) no training example uses. Deterministic from the seed on
a given Python (the docstrings are its standard library's; these files were made with Python 3.11.7).
Run: python experiments/make_long_tailed_data.py
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import importlib
import inspect
import io
import json
import random
import re
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "benchmarks" / "data"
MEDIAN, SIGMA, SHORTEST, LONGEST = 150, 1.0, 40, 2048
SPECIAL = 2  # BOS and EOS around the prompt + completion bytes
# Modules with side effects on import (a browser, a printed poem, a GUI), or only for other platforms.
SKIP = {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "msilib", "msvcrt", "nt", "winreg",
        "winsound", "ensurepip", "pydoc_data", "lib2to3", "distutils"}
LICENSES = Path("/usr/share/common-licenses")


@dataclass(frozen=True)
class Document:
    """source: what the held-out split is drawn by (a module or a license); name: how a prompt refers to it;
    signature: the call signature of a function or class ("" for others)."""

    source: str
    name: str
    signature: str
    text: str

    def title(self, room: int) -> str:
        """The name with its signature when both fit in `room` characters."""
        return self.name + self.signature if len(self.name) + len(self.signature) <= room else self.name


def _usable(text: str | None) -> bool:
    # ASCII keeps one token a character; the special tokens' spellings would be parsed as special tokens.
    return bool(text) and text.isascii() and not any(s in text for s in ("<s>", "</s>", "<pad>"))


def _signature(obj) -> str:
    """The call signature, without the memory addresses of default values' reprs (they change every run)."""
    try:
        return re.sub(r" at 0x[0-9a-f]+", "", str(inspect.signature(obj)))
    except (TypeError, ValueError):
        return ""


def stdlib_documents() -> list[Document]:
    """The docstrings of the standard library's public top-level modules and what each defines."""
    docs, seen = [], set()

    def add(module: str, name: str, obj):
        text = inspect.getdoc(obj)
        if _usable(text) and text not in seen:
            seen.add(text)
            docs.append(Document(module, name, "" if inspect.ismodule(obj) else _signature(obj), text))

    for module_name in sorted(n for n in sys.stdlib_module_names if not n.startswith("_") and n not in SKIP):
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            try:
                module = importlib.import_module(module_name)
            except ImportError:  # a module this build lacks (e.g. readline, curses)
                continue
        add(module_name, module_name, module)
        for name, obj in sorted(vars(module).items()):
            if name.startswith("_") or getattr(obj, "__module__", None) != module_name:
                continue
            if inspect.isclass(obj) or inspect.isroutine(obj):
                add(module_name, f"{module_name}.{name}", obj)
            if inspect.isclass(obj):
                for attr, member in sorted(vars(obj).items()):
                    if not attr.startswith("_") and inspect.isroutine(member):
                        add(module_name, f"{module_name}.{name}.{attr}", member)
    return docs


def license_documents() -> list[Document]:
    """The license texts shipped at /usr/share/common-licenses (none where the directory is missing)."""
    paths = sorted(p for p in LICENSES.glob("*") if p.is_file() and not p.is_symlink()) if LICENSES.is_dir() else []
    texts = [(p.name, p.read_text(errors="replace")) for p in paths]
    return [Document(f"license {name}", f"the {name} license", "", text) for name, text in texts if _usable(text)]


def cut(text: str, n: int) -> str:
    """The longest prefix of `text` of at most n characters that ends at a word's end."""
    if len(text) <= n:
        return text
    end = max(text.rfind(" ", 0, n + 1), text.rfind("\n", 0, n + 1))
    return text[:end if end > 0 else n].rstrip()


def first_sentence(text: str) -> str:
    ends = [e for e in (text.find(". ") + 1, text.find("\n\n")) if e > 0]
    return text[:min(ends)] if ends else text


def target_length(rng: random.Random) -> int:
    """An example's length in tokens: log-normal (MEDIAN, SIGMA), redrawn outside [SHORTEST, LONGEST]."""
    while True:
        n = round(rng.lognormvariate(0.0, SIGMA) * MEDIAN)
        if SHORTEST <= n <= LONGEST:
            return n


# A task fills `budget` characters of prompt + completion from a document, or returns None where it cannot.

def docstring_task(doc: Document, budget: int, rng: random.Random) -> tuple[str, str] | None:
    if doc.source.startswith("license"):
        return None
    prompt = f"Docstring of {doc.title(budget // 2)}:\n"
    room = budget - len(prompt)
    return (prompt, cut(doc.text, room)) if room >= 8 else None


def continue_task(doc: Document, budget: int, rng: random.Random) -> tuple[str, str] | None:
    header = f"Continue {doc.title(budget // 4)}:\n"
    room = budget - len(header) - 1
    if room < 16:
        return None
    passage = cut(doc.text, round(room * rng.uniform(0.2, 0.7)))
    completion = cut(doc.text[len(passage):].lstrip(), room - len(passage))
    return (header + passage + "\n", completion) if passage and completion else None


def first_sentence_task(doc: Document, budget: int, rng: random.Random) -> tuple[str, str] | None:
    header = "First sentence of:\n"
    sentence = first_sentence(doc.text)
    room = budget - len(header) - len(sentence) - 1
    return (header + cut(doc.text, room) + "\n", sentence) if room >= len(sentence) else None


def name_task(doc: Document, budget: int, rng: random.Random) -> tuple[str, str] | None:
    if doc.source.startswith("license"):
        return None
    header = "What does this document?\n"
    name = doc.title(budget // 3)
    room = budget - len(header) - len(name) - 1
    return (header + cut(doc.text, room) + "\n", name) if room >= 16 else None


TASKS = (docstring_task, continue_task, first_sentence_task, name_task)


def make_examples(docs: list[Document], n: int, rng: random.Random) -> list[dict]:
    """n examples, each of a drawn length filled by a random task from a random document long enough for it (tasks
    and documents are redrawn, not the length, until one fits)."""
    docs = sorted(docs, key=lambda d: (len(d.text), d.name))
    lengths = [len(d.text) for d in docs]
    examples = []
    while len(examples) < n:
        budget = target_length(rng) - SPECIAL
        first = bisect.bisect_left(lengths, budget)  # documents that can fill the budget
        pair = None
        while pair is None:
            pair = rng.choice(TASKS)(docs[rng.randrange(min(first, len(docs) - 1), len(docs))], budget, rng)
        examples.append({"prompt": pair[0], "completion": pair[1]})
    return examples


def split_documents(docs: list[Document], eval_fraction: float, rng: random.Random):
    """(train, held-out) documents, split by source so no module or license feeds both."""
    sources = sorted({d.source for d in docs})
    held_out = set(rng.sample(sources, max(1, round(eval_fraction * len(sources)))))
    return [d for d in docs if d.source not in held_out], [d for d in docs if d.source in held_out]


def describe(examples: list[dict]) -> str:
    n = sorted(len(e["prompt"]) + len(e["completion"]) + SPECIAL for e in examples)
    pick = lambda q: n[min(len(n) - 1, int(q * len(n)))]
    return (f"{len(n)} examples, tokens: min {n[0]}, median {pick(0.5)}, mean {sum(n) / len(n):.0f}, "
            f"p90 {pick(0.9)}, p99 {pick(0.99)}, max {n[-1]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train", type=int, default=2000)
    parser.add_argument("--eval", type=int, default=200)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    train_docs, eval_docs = split_documents(stdlib_documents() + license_documents(), 0.1, rng)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, docs, n in (("train", train_docs, args.train), ("eval", eval_docs, args.eval)):
        examples = make_examples(docs, n, rng)
        path = args.out / f"long_tailed_{name}.jsonl"
        path.write_text("".join(json.dumps(e) + "\n" for e in examples))
        print(f"{path}: {describe(examples)} from {len(docs)} documents")


if __name__ == "__main__":
    main()
