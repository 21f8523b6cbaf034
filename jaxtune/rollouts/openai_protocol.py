"""The wire format of an external sampler: the requests jaxtune sends to an OpenAI-compatible server (vLLM, vLLM-TPU,
SGLang) and the reading of its replies into token ids and per-token log-probs. Pure functions over dicts; the HTTP is
`external_sampler.py`'s. Each route as the servers' own sources define it, with their paths: the comment above the
routes below; the server flags a user sets: docs/objectives.md.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

# The protocol as the servers' own sources define it (read 2026-12):
# - Completions, `POST /v1/completions` (vLLM `vllm/entrypoints/openai/completion/protocol.py`, `CompletionRequest`):
#   `prompt` may be token ids, one list a prompt (`list[list[int]]`); `n` samples a prompt; `max_tokens`,
#   `temperature`, `top_p`, `top_k` (-1: all, what both vLLM and SGLang read as off), `seed` (sample i of a prompt
#   seeded seed + i, `vllm/v1/engine/parallel_sampling.py`), `stop_token_ids`, `logprobs` (an int: the top-k
#   alternatives; 0 gives the sampled token's log-prob alone), `return_tokens_as_token_ids` (the logprobs' `tokens` as
#   the strings "token_id:<id>", vLLM's `_get_decoded_token`, `vllm/entrypoints/openai/engine/serving.py`) and
#   `return_token_ids` (each choice's `token_ids`, vLLM >= 0.10.2). Choices come prompt-major, the n samples of a
#   prompt consecutive (`index` = prompt x n + sample): GRPO's row order. The stop token (EOS or one of
#   `stop_token_ids`) is the last of `token_ids` with its log-prob (vLLM v1 appends the token before `check_stop`);
#   `finish_reason` "stop" or "length". `logprobs` is `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`.
#   vLLM reports the raw model's log-probs unless the server runs with `--logprobs-mode processed_logprobs` (after
#   temperature, as TRL's GRPOTrainer sets it for its own vLLM): jaxtune's learner scores logits / temperature, so set
#   it.
# - LoRA at run time (vLLM `vllm/entrypoints/openai/models/serving.py`, `OpenAIServingModels.load_lora_adapter`;
#   routes `/v1/load_lora_adapter`, `/v1/unload_lora_adapter` under `vllm/entrypoints/serve/lora/`): JSON
#   `{"lora_name", "lora_path"}` (`load_inplace` to replace a name), `{"lora_name"}` to unload; the reply is text
#   ("Success: ...") or an error object; a name already loaded is HTTP 400. The routes exist only with
#   `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True` in the server's environment and `--enable-lora` (and `--max-lora-rank` >=
#   the adapter's rank, `--max-loras` >= 2 while one is swapped for the next). A request then names the adapter as its
#   `model`.
# - SGLang (`python/sglang/srt/entrypoints/http_server.py`, `python/sglang/srt/managers/io_struct.py`): `POST
#   /load_lora_adapter` and `/unload_lora_adapter` with the same `lora_name` / `lora_path` (server flags
#   `--enable-lora`, `--max-lora-rank`, `--lora-target-modules`), and `POST /update_weights_from_disk` `{"model_path",
#   "load_format", ...}` -> `{"success", "message"}`: merged weights, a Hugging Face directory of the served
#   architecture, read in place. vLLM has no from-disk weight update over HTTP (its `/update_weights` of
#   `serve/dev/rlhf/api_router.py` needs a NCCL/IPC weight-transfer engine and `VLLM_SERVER_DEV_MODE=1`): merged
#   weights go to SGLang only.
# - SGLang's sampling, `POST /generate` (`GenerateReqInput` of `python/sglang/srt/managers/io_struct.py`; the token
#   path RL trainers use, e.g. slime's `rollout/sglang_rollout.py`): `input_ids` one list a row, `sampling_params`
#   {`max_new_tokens`, `temperature`, `top_p`, `top_k` (-1: all), `stop_token_ids`, `no_stop_trim`,
#   `skip_special_tokens`} (an unknown key is refused: no seed is sent), `return_logprob`, `lora_path` (the adapter's
#   name, one a row; `examples/runtime/lora.py`). The reply is a list, a row each in order, with
#   `meta_info.output_token_logprobs` = [[log-prob, token id, text or null], ...] (the stop token included) and
#   `meta_info.finish_reason.type` "stop" / "length". Its SGLang /v1/completions writes logprobs tokens as text, so
#   jaxtune samples SGLang through /generate. The log-probs are after temperature unless the server's environment sets
#   `SGLANG_RETURN_ORIGINAL_LOGPROB` (SGLang-JAX: `RETURN_ORIGINAL_LOGPROB`): leave it unset.
# - Readiness: `GET /health` (200 once the engine serves; both servers), then `GET /v1/models` lists the served names.
COMPLETIONS = "/v1/completions"
GENERATE = "/generate"  # SGLang's
MODELS = "/v1/models"
HEALTH = "/health"
LORA_PATHS = {"vllm": ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"),
              "sglang": ("/load_lora_adapter", "/unload_lora_adapter")}
UPDATE_FROM_DISK = "/update_weights_from_disk"  # SGLang's
SERVERS = tuple(LORA_PATHS)
TOKEN_PREFIX = "token_id:"


class ProtocolError(ValueError):
    """A reply that is not what the protocol says; the message names what (the caller adds the URL)."""


def completion_request(model: str, prompts: Sequence[Sequence[int]], n: int, max_tokens: int, temperature: float,
                       top_k: int, top_p: float, seed: int, stop_token_ids: Sequence[int]) -> dict:
    """The body of `POST /v1/completions` sampling `n` completions of each token-id prompt, each with the sampled
    tokens' ids and log-probs (`logprobs` 0: the sampled token's alone)."""
    return {"model": model, "prompt": [list(map(int, p)) for p in prompts], "n": n, "max_tokens": max_tokens,
            "temperature": temperature, "top_p": top_p, "top_k": top_k if top_k > 0 else -1, "seed": seed,
            "stop_token_ids": sorted(set(map(int, stop_token_ids))), "logprobs": 0,
            "return_tokens_as_token_ids": True, "return_token_ids": True, "skip_special_tokens": False,
            "stream": False}


def generate_request(adapter: str | None, rows: Sequence[Sequence[int]], max_tokens: int, temperature: float,
                     top_k: int, top_p: float, stop_token_ids: Sequence[int]) -> dict:
    """The body of SGLang's `POST /generate` sampling one completion of each row (a prompt repeated n times for n)
    with the sampled tokens' log-probs, from the adapter named `adapter` (None: the served weights)."""
    sampling = {"max_new_tokens": max_tokens, "temperature": temperature, "top_p": top_p,
                "top_k": top_k if top_k > 0 else -1, "stop_token_ids": sorted(set(map(int, stop_token_ids))),
                "no_stop_trim": True, "skip_special_tokens": False}
    body = {"input_ids": [list(map(int, r)) for r in rows], "return_logprob": True, "sampling_params": sampling}
    if adapter is not None:
        body["lora_path"] = [adapter] * len(rows)
    return body


def lora_load_request(name: str, path: str, inplace: bool = False) -> dict:
    """inplace: replace the adapter loaded under `name` (vLLM's `load_inplace`; else a loaded name is HTTP 400)."""
    return {"lora_name": name, "lora_path": path, **({"load_inplace": True} if inplace else {})}


def lora_unload_request(name: str) -> dict:
    return {"lora_name": name}


def update_from_disk_request(path: str) -> dict:
    return {"model_path": path}


def token_id(token) -> int:
    """The id of a logprobs token written as "token_id:<id>" (`return_tokens_as_token_ids`)."""
    if isinstance(token, str) and token.startswith(TOKEN_PREFIX) and token[len(TOKEN_PREFIX):].lstrip("-").isdigit():
        return int(token[len(TOKEN_PREFIX):])
    raise ProtocolError(f"token {str(token)[:40]!r} is not \"token_id:<id>\" (does the server support "
                        "return_tokens_as_token_ids?)")


def read_completions(reply, rows: int, vocab_size: int | None) -> tuple[list[list[int]], list[list[float]]]:
    """(token ids, log-probs) of each of the `rows` choices of a `/v1/completions` reply, in `index` order. A
    log-prob the server wrote as null is NaN (`rollout_batch`: not reported). Raises ProtocolError naming what is
    missing or wrong: no choices or the wrong number, no logprobs, ids and log-probs of different lengths, an id
    outside [0, vocab_size)."""
    if not isinstance(reply, dict) or not isinstance(reply.get("choices"), list):
        raise ProtocolError("the reply has no \"choices\" list")
    choices = reply["choices"]
    if len(choices) != rows:
        raise ProtocolError(f"{len(choices)} choices for {rows} rows (prompts x n)")
    try:
        choices = sorted(choices, key=lambda c: int(c["index"]))
    except (KeyError, TypeError, ValueError):
        raise ProtocolError("a choice has no integer \"index\"") from None
    completions, logps = [], []
    for choice in choices:
        where = f"choice {choice['index']}"
        logprobs = choice.get("logprobs")
        if not isinstance(logprobs, dict) or not isinstance(logprobs.get("token_logprobs"), list):
            raise ProtocolError(f"{where} has no logprobs.token_logprobs (the request asks for logprobs = 0)")
        values = logprobs["token_logprobs"]
        if isinstance(choice.get("token_ids"), list):
            ids = choice["token_ids"]
        elif isinstance(logprobs.get("tokens"), list):
            ids = [token_id(t) for t in logprobs["tokens"]]
        else:
            raise ProtocolError(f"{where} has neither token_ids nor logprobs.tokens")
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise ProtocolError(f"{where}: token_ids are not all integers")
        if len(ids) != len(values):
            raise ProtocolError(f"{where}: {len(ids)} tokens but {len(values)} log-probs")
        bad = [i for i in ids if i < 0 or (vocab_size is not None and i >= vocab_size)]
        if bad:
            raise ProtocolError(f"{where}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
        floats = []
        for v in values:
            if v is not None and not isinstance(v, (int, float)):
                raise ProtocolError(f"{where}: log-prob {str(v)[:40]!r} is not a number")
            floats.append(math.nan if v is None else float(v))
        completions.append([int(i) for i in ids])
        logps.append(floats)
    return completions, logps


def read_generate(reply, rows: int, vocab_size: int | None) -> tuple[list[list[int]], list[list[float]]]:
    """(token ids, log-probs) of each of the `rows` outputs of SGLang's `/generate` reply, in order; the checks of
    `read_completions`."""
    if isinstance(reply, dict) and rows == 1:
        reply = [reply]  # one row: SGLang answers with the object itself
    if not isinstance(reply, list) or len(reply) != rows:
        got = f"{len(reply)} outputs" if isinstance(reply, list) else "not a list"
        raise ProtocolError(f"{got} for {rows} rows (prompts x n)")
    choices = []
    for i, out in enumerate(reply):
        pairs = out.get("meta_info", {}).get("output_token_logprobs") if isinstance(out, dict) else None
        if not isinstance(pairs, list) or not all(isinstance(p, list) and len(p) >= 2 for p in pairs):
            raise ProtocolError(f"output {i} has no meta_info.output_token_logprobs (the request sets return_logprob)")
        choices.append({"index": i, "token_ids": [p[1] for p in pairs],
                        "logprobs": {"token_logprobs": [p[0] for p in pairs]}})
    return read_completions({"choices": choices}, rows, vocab_size)


def error_message(body: bytes) -> str:
    """The message of an error reply: vLLM's `{"error": {"message"}}` (or `{"message"}`), SGLang's
    `{"message"}` / `{"error"}`, FastAPI's `{"detail"}`, else the text itself; one line, at most 300 characters."""
    text = body.decode("utf-8", "replace")
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if isinstance(data, dict):
        for key in ("error", "message", "detail"):
            value = data.get(key)
            if isinstance(value, dict):
                value = value.get("message", value)
            if value:
                text = str(value)
                break
    return one_line(text) or "(no message)"


def one_line(text: str, limit: int = 300) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."
