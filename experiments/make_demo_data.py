"""Writes the demo's data: jaxtune/assets/demo_instructions.jsonl (what `jaxtune demo` fine-tunes on with LoRA)
and jaxtune/assets/demo_corpus.jsonl (plain text its tiny base model is first trained on).

Six small tasks as prompt/completion pairs (a short prompt, since the demo model reads bytes), each with a rule
that generalises to held-out examples (so a better held-out loss means the model learned the rule, not the
answers): capitalise a phrase, reverse word order,
add two numbers, give the first letter of a word, count words, give the next letter of the alphabet.
Run: python experiments/make_demo_data.py
"""

import json
import random
import string
from pathlib import Path

WORDS = """apple river stone cloud green light music table paper window garden silver bread ocean forest
winter summer yellow orange purple little quick happy quiet bright tiger horse eagle whale mouse rabbit
candle pencil rocket planet island valley bridge castle market school doctor farmer sailor singer painter
dragon wizard knight flower butter coffee cookie honey lemon mango pepper salad tomato carrot potato
storm thunder rain snow wind fire earth metal glass cotton wool leather rubber plastic copper iron gold""".split()


def phrase(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n))


def example(rng):
    task = rng.randrange(6)
    if task == 0:
        p = phrase(rng, rng.randint(1, 3))
        return "Write the phrase in capital letters.", p, p.upper()
    if task == 1:
        p = phrase(rng, rng.randint(2, 4))
        return "Reverse the order of the words.", p, " ".join(reversed(p.split()))
    if task == 2:
        a, b = rng.randint(0, 49), rng.randint(0, 49)
        return f"What is {a} plus {b}?", "", str(a + b)
    if task == 3:
        w = rng.choice(WORDS)
        return "What is the first letter of the word?", w, w[0]
    if task == 4:
        p = phrase(rng, rng.randint(1, 6))
        return "How many words are in the phrase?", p, str(len(p.split()))
    c = rng.choice(string.ascii_lowercase[:-1])
    return f"Which letter comes after {c}?", "", chr(ord(c) + 1)


def main(n=1200, seed=0):
    rng = random.Random(seed)
    path = Path(__file__).resolve().parents[1] / "jaxtune" / "assets" / "demo_instructions.jsonl"
    with path.open("w") as f:
        for _ in range(n):
            instruction, inp, output = example(rng)
            prompt = f"Q: {instruction}" + (f" {inp}" if inp else "") + "\nA:"
            f.write(json.dumps({"prompt": prompt, "completion": " " + output}) + "\n")
    print(f"wrote {n} examples to {path}")




def sentence(rng):
    """Plain text for the demo's base model: words, numbers, capitals and the alphabet, but none of the tasks."""
    kind = rng.randrange(4)
    if kind == 0:
        words = phrase(rng, rng.randint(3, 8)).split()
        return " ".join([words[0].capitalize()] + words[1:]) + "."
    if kind == 1:
        return f"There are {rng.randint(0, 99)} {rng.choice(WORDS)} and {rng.randint(0, 99)} {rng.choice(WORDS)}."
    if kind == 2:
        return phrase(rng, rng.randint(1, 4)).upper() + "!"
    start = rng.randrange(20)
    return " ".join(string.ascii_lowercase[start:start + rng.randint(3, 7)])


def write_corpus(n=3000, seed=1):
    rng = random.Random(seed)
    path = Path(__file__).resolve().parents[1] / "jaxtune" / "assets" / "demo_corpus.jsonl"
    with path.open("w") as f:
        for _ in range(n):
            f.write(json.dumps({"prompt": "", "completion": " ".join(sentence(rng) for _ in range(3))}) + "\n")
    print(f"wrote {n} texts to {path}")


if __name__ == "__main__":
    main()
    write_corpus()
